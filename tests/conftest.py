"""Helpers that run the tiny recipe for real: one process, or `accelerate launch` with real ranks on CPU.

Every launch gets a scrubbed environment (nothing of the shell's launcher, W&B or GPU settings), a rendezvous
port outside the kernel's ephemeral range, DeepSpeed's compiled ops from the virtualenv and a datasets cache of
this session's own. Every process a test starts ends with the test: this process is the subreaper of all of
them, so a rank whose launcher died is still found, and whatever a test leaves is stopped for good (SIGCONT,
then SIGKILL). A passing test that left a process running fails at teardown; so does the session if one
survives it."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# Before anything imports `datasets`, which reads its cache location once: this session's own, removed at its end.
SESSION_DIR = Path(tempfile.mkdtemp(prefix="shardtune-tests-"))
os.environ["HF_DATASETS_CACHE"] = str(SESSION_DIR / "datasets")

import psutil  # noqa: E402
import pytest  # noqa: E402

from shardtune.models.tiny_assets import ensure_tiny_assets  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
TINY_RECIPE = REPO / "recipes" / "tiny.py"
# DeepSpeed JIT-compiles its CPU ops into TORCH_EXTENSIONS_DIR: the virtualenv's (built by `make test`), not the
# user's ~/.cache, so that the Makefile's stamp and the ops live and go together.
TORCH_EXTENSIONS_DIR = Path(sys.prefix) / "torch_extensions"
os.environ["TORCH_EXTENSIONS_DIR"] = str(TORCH_EXTENSIONS_DIR)

# What a launch must not inherit from the shell that runs the tests: another launcher's rank and rendezvous,
# accelerate's and FSDP's settings (they would override the config file), GPU selection, a W&B login or project.
SCRUBBED_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                  "SHARDTUNE_FAULT", "SHARDTUNE_MAIN_PROCESS_PORT", "SHARDTUNE_PROCS_PER_NODE"}
SCRUBBED_PREFIXES = ("ACCELERATE_", "FSDP_", "WANDB_", "TORCHELASTIC_", "PET_", "DEEPSPEED_")


def scrubbed(environ: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items()
            if name not in SCRUBBED_NAMES and not name.startswith(SCRUBBED_PREFIXES)}


# Two ranks share the two cores: one thread each, and no W&B unless a test asks for it (offline even then).
# No Hub either: a name that is not a local model is refused at once, not after huggingface_hub's retries.
ENV = {**scrubbed(dict(os.environ)), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(SESSION_DIR / "datasets"),
       "TORCH_EXTENSIONS_DIR": str(TORCH_EXTENSIONS_DIR)}


# The reference run of each strategy, shared by the equivalence and the resume tests: fp32, 8 steps of
# 32 sequences (2 ranks x 8 x 2 accumulation steps, or 1 x 8 x 4 alone), a checkpoint every 2 steps. Weight decay
# is on (so the decay / no-decay split of the parameters is exercised) and there is no warm-up (step 1 updates).
REFERENCE_ARGS = ("--max_steps", "8", "--save_steps", "2", "--save_total_limit", "0", "--mixed_precision", "no",
                  "--per_device_train_batch_size", "8", "--global_batch_size", "32",
                  "--weight_decay", "0.1", "--warmup_ratio", "0")

# `make test` (and CI, which runs it) sets SHARDTUNE_REQUIRE=nvme,slurm: there, a test that cannot run for want of
# libaio or SLURM (both installed by the Makefile) fails instead of skipping. cpu_fp16, a processor feature no
# package installs (tests/launch/test_loss_scaling.py), is required only where a runner is known to have it.
REQUIRED = {name.strip() for name in os.environ.get("SHARDTUNE_REQUIRE", "").split(",") if name.strip()}


def skip_unless_required(feature: str, reason: str) -> None:
    """Skip for want of `feature`, or fail where the run requires it (SHARDTUNE_REQUIRE)."""
    if feature in REQUIRED:
        pytest.fail(f"{reason} (SHARDTUNE_REQUIRE={','.join(sorted(REQUIRED))} makes this a failure)", pytrace=False)
    pytest.skip(reason)


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# --- processes -----------------------------------------------------------------------------------------------

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans of this process's descendants are re-parented to it rather than to init (Linux): a rank whose
    launcher died stays a descendant, found by the teardown below."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def identity(process: psutil.Process) -> tuple[int, float] | None:
    try:
        return process.pid, process.create_time()
    except psutil.Error:
        return None


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every living descendant of `pid` (default: this process), zombies left out."""
    try:
        children = psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []
    living = []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                living.append(child)
        except psutil.Error:
            pass
    return living


def describe(processes: list[psutil.Process]) -> str:
    lines = []
    for process in processes:
        try:
            lines.append(f"pid {process.pid} ({process.status()}): {' '.join(process.cmdline())[:200]}")
        except psutil.Error:
            pass
    return "\n".join(lines)


def stop_for_good(processes: list[psutil.Process]) -> None:
    """SIGCONT (a stopped process cannot die of SIGTERM handlers, and a frozen rank must not hold its launcher)
    then SIGKILL to each, then reap what became this process's children."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(sig)
    psutil.wait_procs(processes, timeout=10)
    reap_orphans()


def reap_orphans() -> None:
    """Collect the exit status of re-parented orphans (never of a child a Popen object still waits for)."""
    own = {process.pid for process in LAUNCHED if process.returncode is None}
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ChildProcessError):
            if child.pid not in own and child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)


def kill_tree(process: subprocess.Popen, ranks: list[psutil.Process] = ()) -> None:
    """Kill a launcher and every process under it: its descendants (and `ranks`, collected earlier) are killed
    first, while the launcher is alive (torch elastic starts each rank in its own session, out of reach of the
    launcher's process group, and a launcher that dies first leaves them orphaned), then the launcher."""
    tree = [*ranks, *descendants(process.pid)]
    stop_for_good(tree)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait()
    stop_for_good(descendants(process.pid))


def wait_for_ranks(launcher: subprocess.Popen, count: int, timeout: float = 120) -> list[psutil.Process]:
    """The launcher's `count` rank processes (those running a recipe), once they have all started. A process a rank
    forks (a helper between fork and exec still shows the rank's command line) is not a rank."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = {}  # recipe process -> its parent's pid
        for process in descendants(launcher.pid):
            with contextlib.suppress(psutil.Error):
                if any("/recipes/" in part and part.endswith(".py") for part in process.cmdline()):
                    running[process] = process.ppid()
        ranks = [process for process, parent in running.items() if parent not in {p.pid for p in running}]
        if len(ranks) >= count:
            return ranks
        assert launcher.poll() is None, f"launcher exited ({launcher.returncode}) before {count} ranks started"
        time.sleep(0.1)
    raise AssertionError(f"{count} ranks not started within {timeout}s")


LAUNCHED: list[subprocess.Popen] = []  # every process the helpers below started, for the teardown


def popen(command: list[str], **options) -> subprocess.Popen:
    process = subprocess.Popen(command, **options)
    LAUNCHED.append(process)
    return process


def pytest_configure(config) -> None:
    become_subreaper()


def pytest_sessionstart(session) -> None:
    """Fail fast where the launches would fail late: a free port range."""
    low, high = ephemeral_ports()
    if not (PORTS.stop <= low or PORTS.start > high):
        pytest.exit(f"test ports {PORTS.start}-{PORTS.stop - 1} overlap the ephemeral range {low}-{high}",
                    returncode=pytest.ExitCode.USAGE_ERROR)


LAUNCH_TESTS = Path(__file__).resolve().parent / "launch"


def pytest_collection_finish(session) -> None:
    """Fail fast where the launches would fail late (a rank JIT-compiling an op for minutes, past its timeout):
    DeepSpeed's compiled ops, checked only when launched tests (tests/launch) were collected. The unit layer launches
    nothing and runs without them (`make unit` right after `make demo`)."""
    if not any(LAUNCH_TESTS in Path(str(item.path)).parents for item in session.items):
        return
    missing = [name for name in deepspeed_op_names() if not (TORCH_EXTENSIONS_DIR / name / f"{name}.so").is_file()]
    if missing:
        pytest.exit(f"DeepSpeed ops {', '.join(missing)} are not built in {TORCH_EXTENSIONS_DIR}: run "
                    "`make .venv/deepspeed-ops` (or TORCH_EXTENSIONS_DIR=... python scripts/build_deepspeed_ops.py)",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def deepspeed_op_names() -> list[str]:
    """What scripts/build_deepspeed_ops.py builds: of the ops the configs load, those this machine's DeepSpeed
    accelerator has (the CUDA one has no shared-memory collectives) and, for async I/O, can build (libaio)."""
    from deepspeed.accelerator import get_accelerator

    builders = [get_accelerator().create_op_builder(name) for name in ("CPUAdamBuilder", "ShareMemCommBuilder")]
    names = [builder.NAME for builder in builders if builder is not None]
    async_io = get_accelerator().create_op_builder("AsyncIOBuilder")
    if async_io is not None and async_io.is_compatible(verbose=False):
        names.append(async_io.NAME)
    return names


def pytest_sessionfinish(session, exitstatus) -> None:
    """The session fails if any process it started outlived it (the per-test teardown should have ended it)."""
    left = descendants()
    if left:
        report = describe(left)
        stop_for_good(left)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nprocesses left running at the end of the session (killed now):\n{report}", file=sys.stderr)
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[CALL_PASSED] = report.passed
    return report


CALL_PASSED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def no_process_left(request):
    """Whatever the test started and left is stopped for good at teardown. A passing test must leave nothing:
    a process still running 10 s after it (its launcher had that long to end its ranks) fails it."""
    before = {identity(process) for process in descendants()}
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [process for process in descendants() if identity(process) not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report = describe(left)
    stop_for_good(left)
    for process in LAUNCHED:
        if process.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
    if left and request.node.stash.get(CALL_PASSED, False):
        pytest.fail(f"the test left processes running (killed now):\n{report}", pytrace=False)


# --- ports ---------------------------------------------------------------------------------------------------

# Rendezvous ports for launches: below the kernel's ephemeral range (32768-60999 by default), where no outgoing
# connection takes one between the check here and the launcher's bind, and above scripts/slurm/train.sbatch's
# 10000-29999. Handed out once each per session, from a start that differs between concurrent sessions; each
# pytest-xdist worker of a session (`make test` runs two) draws from its own share, so two never pick one port.
PORTS = range(30000, 32768)
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
_own_ports = list(PORTS)[WORKER::int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))]
_start = os.getpid() % len(_own_ports)
_next_ports = itertools.cycle(_own_ports[_start:] + _own_ports[:_start])
_given: set[int] = set()


def ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port nothing listens on, outside the ephemeral range, not handed out before in this session."""
    for _ in range(len(_own_ports)):
        port = next(_next_ports)
        if port in _given:
            continue
        try:
            for host in ("127.0.0.1", "0.0.0.0"):
                with socket.socket() as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


# --- runs ----------------------------------------------------------------------------------------------------


def made_once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder `name` that `make` fills once per session, shared by every pytest-xdist worker: the first to ask
    makes it under a lock, the others wait for it and read it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    shared.mkdir(exist_ok=True)
    folder, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> tuple[str, str]:
    # The tiny recipe's own (its module makes them when imported, as every launch does): once, not per launch.
    ensure_tiny_assets(str(REPO / "assets" / "tiny"))
    root = made_once(tmp_path_factory, "assets", lambda folder: ensure_tiny_assets(str(folder / "tiny")))
    return ensure_tiny_assets(str(root / "tiny"))


DEMO_CONFIG = "ds_zero3"  # make demo's (the Makefile's DEMO_CONFIG)
DEMO_OPS = ("deepspeed_shm_comm",)  # what make demo builds for it (scripts/build_deepspeed_ops.py --config)


def extensions_with(folder: Path, ops: tuple[str, ...]) -> Path:
    """A TORCH_EXTENSIONS_DIR holding only `ops`, linked to the suite's built ones: an op a launch compiles beyond
    them appears beside them."""
    folder.mkdir()
    for op in ops:
        (folder / op).symlink_to(TORCH_EXTENSIONS_DIR / op, target_is_directory=True)
    return folder


@pytest.fixture(scope="session")
def reference_run(tiny_assets, tmp_path_factory):
    """reference_run(config) -> output dir of that strategy's reference run (None: one process), run once."""

    def make(root: Path, config: str | None) -> None:
        # Every reference run also measures its peaks by phase (tests/launch/test_memory_phases.py, root/memory).
        env = {"SHARDTUNE_PROFILE_MEMORY": str(root / "memory")}
        # Context parallelism's also answers held-out prompts (tests/launch/test_context_parallel.py): accelerate's
        # CP hooks drop the attention mask in every forward of the model, generation's included.
        samples = ("--generation_samples", str(CP_SAMPLES)) if config and context_parallel_config(config) else ()
        if config == DEMO_CONFIG:  # the demo's config loads the demo's op alone (tests/launch/test_demo_ops.py)
            env["TORCH_EXTENSIONS_DIR"] = str(extensions_with(root / "extensions", DEMO_OPS))
        run_recipe(root / "out", tiny_assets, *REFERENCE_ARGS, *nvme_args(config, root), *samples, config=config,
                   processes=2, env=env)

    def run(config: str | None) -> Path:
        name = f"reference-{config or 'single'}"
        return made_once(tmp_path_factory, name, lambda root: make(root, config)) / "out"

    return run


# One bf16 run per mechanism: autocast (one process; DDP casts the same way), FSDP2's MixedPrecisionPolicy
# (FULL_SHARD; SHARD_GRAD_OP casts the same way) and DeepSpeed's bf16 engine (ZeRO-3; ZeRO-1/2 use the same
# engine). The reference run's arguments in bf16, without intermediate checkpoints; the one process recomputes
# its layers in backward (gradient checkpointing: the same numbers, and its memory is measured too).
BF16_CONFIGS = (None, "fsdp_full_shard", "ds_zero3")


@pytest.fixture(scope="session")
def bf16_run(tiny_assets, tmp_path_factory):
    """bf16_run(config) -> output dir of that config's bf16 run (BF16_CONFIGS), run once; it measures its phases
    too (root/memory) and keeps its output (root/launch.log)."""

    def make(root: Path, config: str | None) -> None:
        checkpointing = ("--gradient_checkpointing", "true") if config is None else ()
        measured_run(root, tiny_assets, *REFERENCE_ARGS, "--mixed_precision", "bf16", "--save_steps", "0",
                     *checkpointing, config=config, processes=2)

    def run(config: str | None) -> Path:
        name = f"bf16-{config or 'single'}"
        return made_once(tmp_path_factory, name, lambda root: make(root, config)) / "out"

    return run


# DeepSpeed where its formulas depend on the rank count and the precision: bf16 on 3 ranks (uneven partitions;
# on 2 ranks in fp32 the ZeRO-1, ZeRO-2 and ZeRO-3 gradient terms coincide), ZeRO-3's partitions cut into several
# optimizer sub-groups (TINY_ZERO_SIZES). Two steps of 2 micro-batches of 4 sequences per rank, then the save and
# the eval: the steps and phases the profiler measures. ZeRO-1 and ZeRO-2 also pack their micro-batches, ZeRO-1
# with recomputation, so that full fine-tuning's phases are measured packed and recomputed too.
THREE_RANKS = 3
THREE_RANK_ARGS = ("--max_steps", "2", "--mixed_precision", "bf16", "--per_device_train_batch_size", "4",
                   "--global_batch_size", "24", "--save_steps", "0")
THREE_RANK_RUNS = {"ds_zero1": ("--packing", "true", "--gradient_checkpointing", "true"),
                   "ds_zero2": ("--packing", "true"), "ds_zero3": ()}
THREE_RANK_CONFIGS = tuple(THREE_RANK_RUNS)


@pytest.fixture(scope="session")
def three_rank_run(tiny_assets, tmp_path_factory):
    """three_rank_run(config) -> output dir of that DeepSpeed config's 3-rank bf16 run, run once; it measures its
    phases (root/memory) and keeps its output (root/launch.log)."""

    def run(config: str) -> Path:
        return made_once(tmp_path_factory, f"three-ranks-{config}", lambda root: measured_run(
            root, tiny_assets, *THREE_RANK_ARGS, *THREE_RANK_RUNS[config], config=config,
            processes=THREE_RANKS)) / "out"

    return run


def measured_run(root: Path, assets: tuple[str, str], *args: str, **options) -> Path:
    """Run the recipe into root/out with its phases measured (root/memory) and its output kept (root/launch.log)."""
    result = run_recipe(root / "out", assets, *args, env={"SHARDTUNE_PROFILE_MEMORY": str(root / "memory")},
                        **options)
    (root / "launch.log").write_text(result.stdout + result.stderr)
    return root / "out"


# LoRA on a frozen fp32 base, with recomputation, 4 steps (tests/launch/test_peft.py): padded under DDP, packed
# under FSDP and ZeRO-3, so packed training is compared with padded and measured by phase
# (tests/launch/test_memory_phases.py).
LORA_ARGS = (*REFERENCE_ARGS, "--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0",
             "--gradient_checkpointing", "true", "--max_steps", "4", "--save_steps", "4")
LORA_STRATEGIES = {"ddp": (), "fsdp_full_shard": ("--packing", "true"), "ds_zero3": ("--packing", "true")}


@pytest.fixture(scope="session")
def lora_run(tiny_assets, tmp_path_factory):
    """lora_run(config) -> output dir of that config's LoRA run (LORA_STRATEGIES), run once; it measures its
    phases too (root/memory)."""

    def run(config: str) -> Path:
        return made_once(tmp_path_factory, f"lora-{config}", lambda root: measured_run(
            root, tiny_assets, *LORA_ARGS, *LORA_STRATEGIES[config], config=config, processes=2)) / "out"

    return run


def nvme_args(config: str | None, root: Path) -> tuple[str, ...]:
    if "nvme" not in (config or ""):
        return ()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        skip_unless_required("nvme", "NVMe offload needs libaio for DeepSpeed's async_io op: apt-get install "
                                     "libaio-dev")
    (root / "nvme").mkdir(exist_ok=True)
    return ("--offload_nvme_path", str(root / "nvme"))


# Every DeepSpeed launch here runs its config's shipped JSON with these sizes (elements) in place of the shipped
# ones, scaled to the tiny model (98,112 parameters, a decoder layer of 46,208, the largest matrix 11,264) as the
# shipped sizes are to a 70B model: several reduce buckets per backward, a prefetch bucket of about one layer,
# persistent norms, k_proj and v_proj, about 12 optimizer sub-groups per rank on 2 ranks, NVMe parameter buffers of
# at least the largest matrix. So buckets, prefetch and sub-groups chunk on the tiny model as on a large one, and
# the tests plan the same file (`strategy_as_launched`). ZeRO++'s hpZ group is the 2 processes of a loopback machine
# (tests/launch/test_multinode_layouts.py), as it is the 8 GPUs of a node. A size the shipped JSON does not set
# stays unset.
TINY_ZERO_SIZES = {"reduce_bucket_size": 12_000, "allgather_bucket_size": 12_000,
                   "stage3_prefetch_bucket_size": 46_000, "stage3_param_persistence_threshold": 2_500,
                   "stage3_max_live_parameters": 100_000, "stage3_max_reuse_distance": 100_000,
                   "sub_group_size": 4_000, "zero_hpz_partition_size": 2}
TINY_NVME_PARAM_BUFFER_SIZE = 12_288


GPUS_PER_NODE = 8  # the shipped configs are written for nodes of 8 GPUs


def config_machines(config: str) -> int:
    """The nodes a shipped accelerate config is written for (its num_processes over nodes of 8 GPUs; its
    num_machines is 1, the nodes given at launch): the multi-machine layouts (hybrid sharding, ZeRO++ hpZ, TP over
    FSDP2) say 16 and run on 2 loopback machines (tests/launch/test_multinode_layouts.py), not in the 2-process
    reference runs."""
    import yaml

    processes = int(yaml.safe_load((CONFIGS / f"{config}.yaml").read_text()).get("num_processes", 1))
    return max(1, processes // GPUS_PER_NODE)


def tiny_deepspeed_json(config: str) -> Path:
    """The JSON that DeepSpeed launches of `config` run in the tests (written once per session)."""
    import yaml

    path = SESSION_DIR / "deepspeed" / f"{config}.json"
    if not path.exists():
        launch = yaml.safe_load((CONFIGS / f"{config}.yaml").read_text())
        settings = json.loads((REPO / launch["deepspeed_config"]["deepspeed_config_file"]).read_text())
        zero = settings["zero_optimization"]
        zero.update({key: value for key, value in TINY_ZERO_SIZES.items() if key in zero})
        if "buffer_size" in zero.get("offload_param", {}):
            zero["offload_param"]["buffer_size"] = TINY_NVME_PARAM_BUFFER_SIZE
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(settings, indent=2))
    return path


def context_parallel_config(config: str) -> bool:
    """A shipped config with context parallelism (parallelism_config_cp_size): the tests cut every sequence over
    every process they launch (its YAML says 8, a node's GPUs), through CONTEXT_PARALLEL_PROBE: torch has no CPU
    kernel for its ring attention, which the probe adds."""
    import yaml

    parallelism = yaml.safe_load((CONFIGS / f"{config}.yaml").read_text()).get("parallelism_config") or {}
    return "parallelism_config_cp_size" in parallelism


CONTEXT_PARALLEL_PROBE = REPO / "tests" / "launch" / "context_parallel_probe.py"
CP_SAMPLES = 3


def splits_sequences(config: str) -> bool:
    """A shipped config with the sequence split (parallelism_config_sp_size): the tests split over every process
    they launch (its YAML says 8, a node's GPUs)."""
    import yaml

    parallelism = yaml.safe_load((CONFIGS / f"{config}.yaml").read_text()).get("parallelism_config") or {}
    return "parallelism_config_sp_size" in parallelism


# The tests launch a tensor-parallel config (fsdp_tp.yaml: 8 GPUs of a node x 2 nodes) as tp 2 x dp_shard
# processes / 2 (tests/launch/test_tensor_parallel.py).
TESTED_TP_SIZE = 2


def tensor_parallel_launch_args(processes: int) -> tuple[str, ...]:
    """The launch arguments of fsdp_tp.yaml on `processes` CPU processes: TESTED_TP_SIZE x the rest as dp_shard."""
    return ("--parallelism_config_tp_size", str(TESTED_TP_SIZE),
            "--parallelism_config_dp_shard_size", str(processes // TESTED_TP_SIZE))


def strategy_as_launched(config: str, mixed_precision: str = "no", processes: int = 2):
    """The planner's Strategy for `config` as the tests launch it (DeepSpeed: with tiny_deepspeed_json; a sequence
    split over the `processes`; a tensor-parallel config at TESTED_TP_SIZE, tensor_parallel_launch_args; context
    parallelism over the `processes`)."""
    from dataclasses import replace

    from shardtune.plan.strategy import read_accelerate_config

    json_file = str(tiny_deepspeed_json(config)) if config.startswith("ds_") else None
    strategy = read_accelerate_config(str(CONFIGS / f"{config}.yaml"), mixed_precision, json_file)
    if strategy.tensor_parallel > 1:
        strategy = replace(strategy, tensor_parallel=TESTED_TP_SIZE)
    if strategy.context_parallel > 1:  # every sequence over all the processes (tests/launch/test_context_parallel.py)
        strategy = replace(strategy, context_parallel=processes)
    return replace(strategy, sequence_split=processes) if splits_sequences(config) else strategy


def overridden(base: list[str], args: Sequence[str]) -> list[str]:
    """`base` and then `args`, each flag kept at its last occurrence only: a test overrides a flag by giving it again,
    and a recipe refuses a flag given twice with different values (argparse would keep the last without a word)."""
    tokens, items = [*base, *args], []  # (the flag, or None for a stray token; its tokens)
    index = 0
    while index < len(tokens):
        token = tokens[index]
        takes_value = token.startswith("--") and "=" not in token and index + 1 < len(tokens) \
            and not tokens[index + 1].startswith("--")
        items.append((token.partition("=")[0] if token.startswith("--") else None,
                      tokens[index:index + 2] if takes_value else [token]))
        index += 2 if takes_value else 1
    last = {flag: position for position, (flag, _) in enumerate(items) if flag}
    return [token for position, (flag, group) in enumerate(items) if flag is None or last[flag] == position
            for token in group]


def recipe_command(
    output_dir: Path, assets: tuple[str, str], *args: str, config: str | None = None, processes: int = 1,
    launch_args: tuple[str, ...] = (), recipe: Path = TINY_RECIPE, port: int | None = None,
) -> list[str]:
    """The command that runs the tiny recipe on the given model and data; with `config`, accelerate's launcher
    (DeepSpeed configs with tiny_deepspeed_json unless `launch_args` names a JSON of its own)."""
    if config and config.startswith("ds_") and "--deepspeed_config_file" not in launch_args:
        launch_args = (*launch_args, "--deepspeed_config_file", str(tiny_deepspeed_json(config)))
    if config and splits_sequences(config) and "--parallelism_config_sp_size" not in launch_args:
        launch_args = (*launch_args, "--parallelism_config_sp_size", str(processes))
    if config and context_parallel_config(config) and "--parallelism_config_cp_size" not in launch_args:
        launch_args = (*launch_args, "--parallelism_config_cp_size", str(processes),
                       "--parallelism_config_dp_shard_size", "1")
        recipe = CONTEXT_PARALLEL_PROBE if recipe == TINY_RECIPE else recipe
    model_dir, data_file = assets
    # No generated samples unless a test asks (tests/launch/test_outputs.py): they cost every launch's final eval time.
    recipe_args = overridden(["--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir",
                              str(output_dir), "--report_to", "none", "--logging_steps", "1", "--eval_steps", "0",
                              "--use_cpu", "true", "--generation_samples", "0"], args)
    if config is None:
        command = [sys.executable, str(recipe), *recipe_args]
    else:
        # accelerate's launcher alone (its `accelerate-launch` script: the same launch_command as `accelerate launch`),
        # without the CLI's other commands, whose imports (transformers, for `estimate-memory`) cost each launch about
        # a CPU-second. `accelerate launch` itself is run as users type it in tests/launch/test_bad_input.py and by
        # scripts/slurm/train.sbatch (tests/launch/test_slurm.py).
        launcher = str(Path(sys.executable).parent / "accelerate-launch")
        command = [launcher, "--config_file", str(CONFIGS / f"{config}.yaml"), "--num_processes", str(processes),
                   "--main_process_port", str(port or free_port()), *launch_args, str(recipe), *recipe_args]
    return command


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**ENV, **(extra or {})}


def run_recipe(output_dir: Path, assets: tuple[str, str], *args: str, check: bool = True,
               env: dict[str, str] | None = None, timeout: float = 900, **options) -> subprocess.CompletedProcess:
    command = recipe_command(output_dir, assets, *args, **options)
    process = popen(command, cwd=output_dir.parent, env=launch_env(env), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        raise AssertionError(f"{' '.join(command)}\nstill running after {timeout}s: a hang") from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)}\nexit {result.returncode}\n{result.stderr[-6000:]}")
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(output_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(output_dir) if "loss" in row]


def grad_norms(output_dir: Path) -> list[float]:
    """The gradient norm of each step before clipping: where a lost or doubled gradient factor shows, although
    clipping and Adam hide it from the losses and the weights."""
    return [row["grad_norm"] for row in read_metrics(output_dir) if "loss" in row]


def start_recipe(output_dir: Path, assets: tuple[str, str], *args: str, log_name: str | None = None,
                 env: dict[str, str] | None = None, **options) -> subprocess.Popen:
    """Start a run in its own session; `kill_tree` ends it with all its ranks, the teardown whatever is left."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(output_dir.parent / f"{log_name or output_dir.name}.log", "w")  # noqa: SIM115 (closed with the process)
    return popen(recipe_command(output_dir, assets, *args, **options), cwd=output_dir.parent, env=launch_env(env),
                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_machines(output_dir: Path, assets: tuple[str, str], *args: str, configs: list[str],
                   machine_args: list[tuple[str, ...]] | None = None,
                   machine_env: list[dict[str, str]] | None = None, processes_per_machine: int = 1,
                   launch_args: tuple[str, ...] = (), recipe: Path = TINY_RECIPE) -> list[subprocess.Popen]:
    """One `accelerate launch` per machine, all on loopback, `processes_per_machine` processes each: machine i
    runs configs[i] with `args`, machine_args[i] and the variables machine_env[i]; `launch_args` go to every
    launcher. Logs go to <output_dir>-machine<i>.log."""
    port, machines = free_port(), len(configs)
    processes = []
    for rank, config in enumerate(configs):
        machine_launch = ("--num_machines", str(machines), "--machine_rank", str(rank),
                          "--main_process_ip", "127.0.0.1", *launch_args)
        extra = machine_args[rank] if machine_args else ()
        processes.append(start_recipe(output_dir, assets, *args, *extra, config=config,
                                      processes=machines * processes_per_machine,
                                      launch_args=machine_launch, port=port,
                                      log_name=f"{output_dir.name}-machine{rank}",
                                      env=machine_env[rank] if machine_env else None, recipe=recipe))
    return processes


def wait_for_step(process: subprocess.Popen, output_dir: Path, step: int, timeout: float = 300) -> None:
    """Block until the run has logged `step` (or fail if it ends or takes too long)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"run ended (exit {process.returncode}) before step {step}"
        try:
            if any(row.get("step", 0) >= step for row in read_metrics(output_dir)):
                return
        except (OSError, ValueError):  # not written yet, or a line half-written
            pass
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout}s")


def wait_all(processes: list[subprocess.Popen], timeout: float, started: float | None = None) -> list[float]:
    """Seconds from `started` (default: now) until each launcher exited; kills them all, ranks included, and
    fails if any outlives `timeout`."""
    started, ended = started or time.monotonic(), {}
    while len(ended) < len(processes):
        for index, process in enumerate(processes):
            if index not in ended and process.poll() is not None:
                ended[index] = time.monotonic() - started
        if time.monotonic() - started > timeout:
            for process in processes:
                kill_tree(process)
            raise AssertionError(f"launchers still running after {timeout}s: a hang")
        time.sleep(0.1)
    return [ended[index] for index in range(len(processes))]


def machine_log(output_dir: Path, machine: int) -> str:
    return (output_dir.parent / f"{output_dir.name}-machine{machine}.log").read_text()

"""`make device-rehearsal`: the device tool's GPU machine rehearsed on this CPU machine before device time is spent.

It builds (once) a virtualenv of the device's versions (scripts/device_packages.txt: torch 2.11.0, transformers
5.17.0, accelerate 1.15.0, safetensors, tokenizers and huggingface-hub at theirs, and the device's packages the
carried wheels require, at pip's choice where the list gives no version), the carried wheel set for this machine's
Python (scripts/gpu_wheels.py, the same versions) installed into a target directory as the device command installs
it (--no-index --no-deps --no-compile --target), and runs, with that interpreter and PYTHONPATH as on the device,
what the check imports and then each gpu_check case's launch (scripts/gpu_check.launch_command, through
scripts/device_counted_launch.py) on CPU with the tiny model to its end: 3 steps of 4 rows of 64 tokens, the packed
cases' attention in SDPA (flex attention has no backward on CPU). fp8 and Liger need a CUDA GPU: their launches must
end in the trainer's one-line refusal of CPU, which shows that everything up to the device check imported and
parsed. A result line per case; exit 1 if any launch ended otherwise.

This machine has Python 3.11 and the device 3.12: the wheels are the same versions for 3.11 (pydantic-core and
multiprocess differ by build only), and torch 2.11.0 is PyPI's CUDA build, which runs on CPU.

    python scripts/device_rehearsal.py [--root .venv/device-rehearsal] [--cases slug,...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402

from shardtune.checks.command_line import OneLineParser  # noqa: E402
from shardtune.gpu_check.processes import Stopped, run_killing_group, stopping_on_signals  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The device's own packages installed at the version its list gives (the others the set needs at pip's choice).
AT_DEVICE_VERSION = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "huggingface-hub", "triton")
# What the check's own processes import from the device beyond the set's requirements.
CHECK_USES = ("psutil", "pyyaml", "jinja2", "ninja")
SEQ, MICRO, STEPS = 64, 4, 3
CASE_TIMEOUT_S = 900  # a launch on 2 cores: seconds to 2 minutes (the levers compile)
# The trainer's refusal of each GPU-only feature on CPU (levers.liger.check_liger_device, levers.float8).
CPU_REFUSALS = {" liger": "--use_liger_kernel runs Liger's Triton kernels, which need a CUDA GPU",
                " fp8": "--mixed_precision fp8 runs float8 matmuls on CUDA GPUs"}


def device_requirements() -> list[str]:
    """pip's arguments for the device's packages: AT_DEVICE_VERSION pinned, then each device package a carried
    wheel requires (scripts/device_wheels.json) and CHECK_USES, unpinned where the list gives no version."""
    device = gpu_wheels.read_device_packages()
    record = json.loads(gpu_wheels.SET_RECORD.read_text())["wheels"]
    names = {gpu_wheels.normalized(Requirement(line).name) for entry in record.values() for line in entry["requires"]
             if gpu_wheels.applies(Requirement(line))}
    names = ((names | set(CHECK_USES)) - set(record)) | set(AT_DEVICE_VERSION)  # transformers: shadowed, as there
    return sorted(f"{name}=={device[name]}" if name in AT_DEVICE_VERSION else name for name in names if name in device)


def build(root: Path) -> Path:
    """The virtualenv and the installed wheel set under `root` (once; remove `root` to rebuild); the
    interpreter."""
    python = root / "venv" / "bin" / "python"
    if not (root / "venv.done").is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root / "venv")], check=True)
        env = {**os.environ, "PIP_CONSTRAINT": ""}  # this machine's cap is for its own virtualenv
        subprocess.run([str(python), "-m", "pip", "install", "-q", *device_requirements()], check=True, env=env)
        remove_what_the_device_lacks(python)
        (root / "venv.done").write_text("")
    if not (root / "site.done").is_file():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_wheels.py"), "--dest", str(root / "wheels"),
                        "--python_version", version], check=True)
        site = root / "site"
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site),
                        *map(str, sorted((root / "wheels").glob("*.whl")))], check=True)
        (root / "site.done").write_text("")
    return python


def remove_what_the_device_lacks(python: Path) -> None:
    """Uninstall from the virtualenv what pip brought that the device's list does not name (this typer's pydantic:
    the device's typer comes without it, and DeepSpeed must find the carried one)."""
    device = gpu_wheels.read_device_packages()
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            check=True).stdout
    extra = [item["name"] for item in json.loads(listed) if gpu_wheels.normalized(item["name"]) not in device]
    if extra:
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *extra], check=True)


def rehearsal_command(case: gpu_check.Case, python: Path, model: str, data: str, output_dir: Path) -> list[str]:
    """gpu_check's launch of `case` with the rehearsal's interpreter, the tiny model and sizes, on CPU."""
    command = gpu_check.launch_command(case, model, data, output_dir, seq=SEQ, micro=MICRO, steps=STEPS)
    # flex attention has no backward on CPU (the trainer refuses it there): the packed rows' attention runs in SDPA
    return [str(python), *("sdpa" if word == "flex_attention" else word for word in command[1:]), "--use_cpu",
            "true"]


def outcome(case: gpu_check.Case, returncode: int, log: str) -> str:
    """'ok' where the launch ended as it must on CPU, else why not."""
    refusal = CPU_REFUSALS.get(gpu_check.compared_suffix(gpu_check.case_name(*case)))
    if refusal:
        return "ok (refused on CPU as it must be)" if returncode != 0 and refusal in log else \
            f"FAILED: expected the CPU refusal '{refusal}', exit {returncode}"
    if returncode != 0:
        lines = [line for line in log.splitlines() if line.strip()]
        errors = [line for line in lines if "error:" in line.lower()] or lines
        return f"FAILED: exit {returncode}: {errors[-1][:200] if errors else 'no output'}"
    return "ok"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(REPO / ".venv" / "device-rehearsal"),
                        help="the virtualenv, wheels and runs (default: %(default)s, ignored by git)")
    parser.add_argument("--cases", help="comma-separated cases (default: all): " +
                        ",".join(gpu_check.case_slug(case) for case in gpu_check.CASES))
    args = parser.parse_or_exit(argv)
    try:
        cases = gpu_check.selected_cases(args.cases)
    except ValueError as error:
        print(f"device_rehearsal: error: {error}", file=sys.stderr)
        return 2
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    python = build(root)
    from shardtune.models.tiny_assets import ensure_tiny_assets

    model, data = ensure_tiny_assets(str(REPO / "assets" / "tiny"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "site"), str(REPO)]), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    imported = subprocess.run([str(python), "-c", CHECK_IMPORTS], env=env, capture_output=True, text=True, cwd=root)
    versions = imported.stdout.strip().splitlines()[-1] if imported.returncode == 0 else ""
    print(f"device_rehearsal: imports: {versions or 'FAILED: ' + imported.stderr.strip()[-300:]}", flush=True)
    failed = imported.returncode != 0
    runs = root / "runs" / time.strftime("%Y%m%d-%H%M%S")  # each rehearsal's own: nothing earlier is touched
    runs.mkdir(parents=True)
    for case in cases:
        slug = gpu_check.case_slug(case)
        output_dir, log_path = runs / slug, runs / f"{slug}.log"
        command = rehearsal_command(case, python, model, data, output_dir)
        case_env = {**env, "SHARDTUNE_REPLACED_FILE": str(runs / f"{slug}.replaced.json")}
        with stopping_on_signals():  # SIGTERM or SIGINT: the running launch killed whole, ranks included
            try:
                ended = run_killing_group(command, CASE_TIMEOUT_S, log_path, case_env, cwd=root)
            except Stopped as stop:
                print(f"device_rehearsal: stopped by {stop}; {slug} killed", file=sys.stderr)
                return 128 + stop.signum
        log = log_path.read_text(errors="replace")
        result = outcome(case, 1 if ended.returncode is None else ended.returncode, log)
        failed |= result.startswith("FAILED")
        print(f"{slug:<36} {ended.seconds:6.0f} s  {result}; log {log_path}", flush=True)
    return 1 if failed else 0


# What the check's processes import that the device lacks, and the versions they run with.
CHECK_IMPORTS = ("import shardtune.trainer, shardtune.gpu_check.figures, deepspeed, datasets, torchao.float8, "
                 "torchao.optim, liger_kernel.transformers, accelerate.commands.launch, torch, transformers, peft; "
                 "from deepspeed.runtime.engine import DeepSpeedEngine; "
                 "print(f'torch {torch.__version__}, transformers {transformers.__version__} from "
                 "{transformers.__file__.split(\"/transformers/\")[0]}, peft {peft.__version__}, deepspeed "
                 "{deepspeed.__version__}, datasets {datasets.__version__}')")


if __name__ == "__main__":
    sys.exit(main())

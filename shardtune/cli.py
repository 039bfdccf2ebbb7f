"""Entry point of every recipe: flags and checks first, with light imports only, then the trainer."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator

from shardtune.checkpoint.output_dir import OutputDirLock, is_rank_zero
from shardtune.checkpoint.run_settings import resume_point
from shardtune.checks.flag_hints import launch_line
from shardtune.checks.launch_config import accelerate_config_problems
from shardtune.checks.model import check_model
from shardtune.checks.outputs import check_not_occupied
from shardtune.checks.startup import (
    check_hardware_launch,
    check_machine,
    check_on_device,
    check_recipe,
    planned_capability,
)
from shardtune.config import BatchSizes, ConfigError, Problems, Recipe
from shardtune.flags import given_fields, parse_flags
from shardtune.hub import is_hub_id, probe_hub
from shardtune.launch import LaunchDescription
from shardtune.parallel.deepspeed_ops import compile_notice
from shardtune.parallel.launcher_args import (
    check_launcher_precision,
    check_started_by_launcher,
    launcher_precision_note,
    this_launcher,
)
from shardtune.parallel.local_rank import first_on_machine
from shardtune.parallel.planned_launch import launch_environment, planned_launch_environment

# A refused rank that does not print (shardtune.cli.reports_errors) waits this long before it exits, so that the rank
# of its machine that prints the refusal is not stopped by the launcher first.
SILENT_RANK_DELAY_S = 3.0


def main(recipe: Recipe, argv: list[str] | None = None, methods: dict[str, Recipe] | None = None) -> None:
    """Parse overrides, check everything that needs no weights, train. Bad input: one line per problem on stderr
    (and in the launcher's error file), exit code 2. `methods`: a recipe's own settings for another --method
    (its data, learning rate), taken when the command line asks for that method."""
    try:
        with startup_heap_frozen():  # the checks and the trainer import torch, transformers, datasets
            recipe = method_recipe(recipe, methods or {}, sys.argv[1:] if argv is None else argv)
            recipe, launch, batching = checked_launch(recipe, argv)
            resume = resume_point(recipe, launch, batching)
            if is_rank_zero():  # the output directory is this run's until the process ends (checkpoint.output_dir)
                taken_over = OutputDirLock(recipe.resolved_output_dir).acquire(recipe.overwrite_output_dir)
                if taken_over:
                    print(f"shardtune: warning: {taken_over}", file=sys.stderr, flush=True)
                check_not_occupied(recipe)  # a run started beside this one may have written there since its checks
            # DeepSpeed still calls these collectives by their old names, once per layer and step.
            warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
            from shardtune.trainer import train

        train(recipe, batching, launch, resume)
    except ConfigError as error:
        refuse(error.messages)
        if not reports_errors():  # the launcher stops every rank once one exits: the rank that prints goes first
            time.sleep(SILENT_RANK_DELAY_S)
        distributed = sys.modules.get("torch.distributed")  # a refusal before any import of it has no group
        if distributed is not None and distributed.is_initialized():
            distributed.destroy_process_group()
        sys.exit(2)


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, then every object it left frozen (gc.freeze: later
    collections skip them) and the collector on again (if it was). Imports of torch, transformers and datasets
    create about half a million objects that live as long as the process: the collector walked them again and
    again, a quarter of each rank's start-up CPU time, on every rank of a node at once. Frozen only when the block
    ends without raising (a refusal freezes nothing). The cyclic garbage of the block is frozen with it, until
    exit: a few MB of Python objects at start-up (the checks' meta models, no tensor storage), where a collection
    first would cost a third of the time saved. Unfrozen at exit, for the exits through the interpreter (an error
    in training): its last collection then finalizes them (triton's bindings report leaks otherwise)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()  # the run goes on (a refusal raised instead): what it imported stays
        atexit.register(gc.unfreeze)
    finally:
        if enabled:
            gc.enable()


def method_recipe(recipe: Recipe, methods: dict[str, Recipe], argv: list[str]) -> Recipe:
    """The recipe of the --method the command line names, where the recipe declares one for it."""
    for index, token in enumerate(argv):
        name, equals, value = token.partition("=")
        if name == "--method":
            chosen = value if equals else (argv[index + 1] if index + 1 < len(argv) else "")
            return methods.get(chosen, recipe)
    return recipe


def checked_launch(recipe: Recipe, argv: list[str] | None) -> tuple[Recipe, LaunchDescription, BatchSizes]:
    """(the recipe as the command line sets it, the launch, batch sizes) once every check that needs no weights
    passed, in two stages that each raise one ConfigError listing all their failures: first the command line and
    the launch environment (flags, values, data paths, the batch over the ranks), then this machine, the model's
    config and the memory plan. --dry_run stops after the first, with the memory plan of --hardware."""
    problems = Problems()
    recipe, flag_problems = parse_flags(recipe, argv)
    problems.messages.extend(flag_problems)
    given = given_fields(recipe, argv)
    if os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true":  # use_cpu: true in the accelerate config
        recipe = dataclasses.replace(recipe, use_cpu=True)
    if recipe.dry_run:  # plans the launch on --hardware, not this machine's
        sys.exit(dry_run(recipe, problems, given))
    # What `accelerate launch` was asked, read from its command line (one walk up the process tree): a setting it
    # did not pass on is refused, and its config file's keys are checked.
    launcher = this_launcher() if launched() else None
    launch = problems.check(LaunchDescription.from_env, launcher)
    if launch is not None:
        problems.check(check_launcher_precision, recipe, launch.launcher_precision, launch.launcher_precision_source)
    if recipe.config_file:  # accelerate launch reads a config; the script only plans one under --dry_run
        problems.messages.append(f"--config_file is read only with --dry_run (to plan that config): to train under "
                                 f"it, give it to the launcher: {launch_line(recipe.config_file)}")
    batching = check_recipe(recipe, problems, launch, given)
    if launch is not None:
        problems.check(check_hardware_launch, recipe, launch)
    # This machine's GPU, the model's config and the memory plan need torch and transformers, seconds of imports:
    # a command line that its own checks refuse is refused now; the rest is judged once it is right.
    problems.raise_any()
    assert launch is not None  # no problems: the launch was read
    import torch

    check_machine(recipe, problems, torch.cuda.is_available(), launch)
    config_file = launcher.config_path if launcher else None
    if config_file:  # accelerate ignores a misspelt key of a section: the run would go without that setting
        problems.messages.extend(accelerate_config_problems(config_file))
    if recipe.model_name_or_path:
        if is_hub_id(recipe.model_name_or_path) and not os.path.isdir(recipe.model_name_or_path):
            probe_hub()  # out of reach: the lookup fails at once, not after huggingface_hub's retries
        problems.check(check_model, recipe, launch.sp_size, launch.tp_size, launch.cp_size)
        # The plan of the launched config, a refusal among the others if it does not fit.
        problems.check(print_memory_plan, recipe, launch, bool(recipe.hardware))
    problems.raise_any()
    # Whether a launcher started the ranks at all is judged once the run is right in every other respect.
    check_started_by_launcher(launch.uses_deepspeed)
    note = launcher_precision_note(recipe, launch.launcher_precision, launch.launcher_precision_source)
    if note and is_rank_zero():
        print(f"shardtune: note: {note}", file=sys.stderr, flush=True)
    if launch.uses_deepspeed and first_on_machine():  # each machine compiles its own
        compiling = compile_notice(launch.strategy(recipe.mixed_precision), config_file)
        if compiling:
            print(f"shardtune: note: {compiling}", file=sys.stderr, flush=True)
    assert batching is not None  # no problems: batch_sizes returned
    return recipe, launch, batching


# --- --dry_run ---------------------------------------------------------------------------------------------------

def dry_run(recipe: Recipe, problems: Problems, given: frozenset[str]) -> int:
    """--dry_run: every check a launch makes of the command line (checks.check_recipe and check_on_device), under
    the launch it plans on --hardware's GPUs, all reported together, then the plan. What it leaves out, the checks
    of the machine, the data and the output dir, is checks.NOT_IN_DRY_RUN. Outside `accelerate launch` it plans
    --config_file or the config in the recipe's launch line, as accelerate's launcher would launch it on
    --hardware; under it, the launched config on --hardware's GPUs."""
    if not recipe.model_name_or_path:
        problems.messages.append("No model: set --model_name_or_path to a local model directory or a Hub model id.")
    hardware = problems.check(planned_hardware, recipe.hardware) if recipe.hardware else None
    if hardware is None and not recipe.hardware:
        problems.messages.append("--dry_run needs --hardware (e.g. 8xh100-80gb): the hardware to plan for.")
    config_file, is_launched = None, launched()  # asked once: the planned launch's variables make any run look launched
    if is_launched:
        launcher = this_launcher()
        config_file = launcher.config_path if launcher else None
        read = bool(config_file)
    else:
        config_file = recipe.config_file or recipe_config_file()
        read = bool(config_file) and os.path.isfile(config_file)
        if not config_file:
            problems.messages.append("--dry_run outside accelerate launch plans the accelerate config that "
                                     "--config_file names: give one (e.g. accelerate_configs/fsdp_full_shard.yaml).")
        elif not read:
            problems.messages.append(f"--config_file {config_file!r} does not exist: give an accelerate config YAML.")
    key_problems = accelerate_config_problems(config_file) if read else []
    problems.messages.extend(key_problems)
    env = None
    if hardware is not None and (is_launched or read) and not key_problems:
        env = problems.check(planned_environment, hardware, None if is_launched else config_file)
    if env is None:  # no launch to plan (a problem says why): the checks that need none
        check_recipe(recipe, problems, None, given, planned=True)
        raise ConfigError(problems.messages)
    with launch_environment(env):  # every check reads the planned launch where a run reads its own
        launch = problems.check(LaunchDescription.from_env)
        check_recipe(recipe, problems, launch, given, planned=True)
        if launch is not None:
            check_on_device(recipe, problems, launch, True, planned_capability(hardware), loads=False)
        problems.raise_any()
        assert launch is not None  # no problems: the launch was read
        return print_memory_plan(recipe, launch, required=True, config_file=None if is_launched else config_file)


def planned_environment(hardware, config_file: str | None) -> dict[str, str]:
    """The variables of the launch a dry run plans: `config_file` launched on `hardware` by accelerate's launcher,
    or, with None, this launch's own accelerate variables on `hardware`'s ranks."""
    if config_file:
        return planned_launch_environment(config_file, hardware.nodes, hardware.gpus_per_node)
    own = {name: value for name, value in os.environ.items()
           if name.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}
    return {**own, "WORLD_SIZE": str(hardware.world_size), "LOCAL_WORLD_SIZE": str(hardware.gpus_per_node),
            "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29500")}


def planned_hardware(spec: str):
    from shardtune.plan.hardware import HardwareError, parse_hardware

    try:
        return parse_hardware(spec)
    except HardwareError as error:
        raise ConfigError(str(error)) from None


def launched() -> bool:
    """Started by `accelerate launch` (or torchrun), which exports the config as ACCELERATE_* variables."""
    return "WORLD_SIZE" in os.environ or any(name.startswith("ACCELERATE_") for name in os.environ)


def recipe_config_file() -> str | None:
    """The accelerate config in the launch line of the running recipe's header, found from the working directory
    or from the repository the recipe lives in."""
    recipe = sys.modules.get("__main__")
    match = re.search(r"--config_file\s+(\S+\.ya?ml)", getattr(recipe, "__doc__", None) or "")
    if not match:
        return None
    path = match.group(1)
    repository = os.path.dirname(os.path.dirname(os.path.abspath(getattr(recipe, "__file__", "."))))
    return path if os.path.isfile(path) or os.path.isabs(path) else os.path.join(repository, path)


def refuse(messages: list[str]) -> None:
    """Print the refusal, and leave it where torchelastic's launcher (`accelerate launch` with several processes)
    looks for the cause of a failure: each rank's TORCHELASTIC_ERROR_FILE, in the JSON that torch's own
    ErrorHandler.record_exception writes (torch/distributed/elastic/multiprocessing/errors). The launcher's closing
    report then shows these lines under "Root Cause" instead of "To enable traceback see ...". Every rank writes
    its file, including those that do not print: the root cause is the failure with the earliest timestamp, and a
    rank without a file is stamped when the launcher notices it, which can be first."""
    lines = [f"shardtune: error: {' '.join(message.splitlines())}" for message in messages]  # one line each
    if reports_errors():
        print("\n".join(lines), file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        text = "\n".join(lines)
        record = {"message": {"message": text, "extraInfo": {"py_callstack": text,
                                                             "timestamp": str(int(time.time()))}}}
        with contextlib.suppress(OSError), open(error_file, "w") as file:  # the lines above were printed anyway
            json.dump(record, file)


def reports_errors() -> bool:
    """The first rank of each machine prints the error that every rank hits, so that each machine's log says why
    it stopped; a rank whose own RANK or WORLD_SIZE is wrong prints its own."""
    try:
        valid = 0 <= int(os.environ.get("RANK", "0")) < int(os.environ.get("WORLD_SIZE", "1"))
        return not valid or first_on_machine()
    except ValueError:
        return True


def print_memory_plan(recipe: Recipe, launch: LaunchDescription, required: bool, config_file: str | None = None
                      ) -> int:
    """Plan this launch's memory per GPU (under `config_file` instead of the launched config, for a dry run)
    before any weight loads; raise ConfigError if it does not fit. Without --hardware and without GPUs there is
    nothing to plan against (returns 0)."""
    from shardtune.models.flops import ModelError, builtin_name, resolve_model
    from shardtune.plan.hardware import HardwareError
    from shardtune.plan.launched import launch_hardware, launch_strategy, plan_launch
    from shardtune.plan.report import format_plan
    from shardtune.plan.strategy import PlanError

    try:
        hardware = launch_hardware(recipe.hardware, launch)
        if hardware is None:
            if required:
                raise ConfigError("--dry_run needs --hardware (e.g. 8xh100-80gb) on a machine without GPUs.")
            return 0
        name = recipe.model_name_or_path
        if is_hub_id(name) and not builtin_name(name) and not os.path.exists(name):
            probe_hub()  # out of reach: the lookup fails at once, not after huggingface_hub's retries
        shape = resolve_model(name)
    except (HardwareError, ModelError) as error:
        if required:
            raise ConfigError(str(error)) from error
        print(f"shardtune: no memory plan: {error}", file=sys.stderr)
        return 0
    try:
        chosen, alternative = plan_launch(shape, hardware, recipe, launch_strategy(recipe, launch, config_file))
    except PlanError as error:  # a config file or LoRA target the planner cannot use
        raise ConfigError(str(error)) from None
    if int(os.environ.get("RANK", "0")) == 0:  # flushed: the launcher may stop this rank when another exits first
        print(format_plan(chosen), flush=True)
    if alternative:
        raise ConfigError(f"{shape.name} does not fit {hardware.name} with {chosen.config}: its limit is "
                          f"{chosen.binding_limit()}. {alternative}")
    return 0

"""What `accelerate launch` was asked on its own command line, as its ranks can tell. accelerate exports a config's
settings to the ranks as variables, but drops some of its flags without a word (parallelism sizes beside a config
without a parallelism_config section, --num_processes where it starts the script once) and exports the mixed
precision the same whether its flag or its config file set it. The launcher's command line is read from the rank's
ancestor process and run through accelerate's own parser and its own defaulting from the config file
(commands/launch.py `_validate_launch_command`), so what it was asked is what accelerate itself read."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from shardtune.config import ConfigError, Recipe

LAUNCHER_DEPTH = 4  # a rank's ancestors looked at for its launcher: the launcher itself, or a wrapper around it
PARALLELISM_SIZES = ("tp", "cp", "sp", "dp_shard", "dp_replicate")
# The shipped config that applies each parallelism size, named by the refusal of a size accelerate did not pass on.
SUPPORTING_CONFIG = {
    "tp": "accelerate_configs/fsdp_tp.yaml (TP with FSDP2), or for TP alone a copy of ddp.yaml with the section "
          "parallelism_config: {parallelism_config_tp_size: N}",
    "cp": "accelerate_configs/fsdp_cp.yaml",
    "sp": "accelerate_configs/ds_zero3_ulysses.yaml",
    "dp_shard": "accelerate_configs/fsdp_hybrid_shard.yaml",
    "dp_replicate": "accelerate_configs/fsdp_hybrid_shard.yaml",
}



def script_shown() -> str:
    """The recipe as a fix names it: the script this process runs, else a placeholder (a test, an interpreter)."""
    return os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "recipes/<recipe>.py"

def launcher_command() -> tuple[list[str], str] | None:
    """(the command line, the working directory) of the `accelerate launch` this process runs under: the rank's
    parent under torchrun's agent and the simple launcher, an ancestor a few levels up under a wrapper. None when
    no ancestor is `accelerate launch`."""
    import psutil

    with contextlib.suppress(psutil.Error):
        process = psutil.Process().parent()
        for _ in range(LAUNCHER_DEPTH):
            if process is None:
                break
            argv = process.cmdline()
            if launch_options(argv) is not None:
                return argv, process.cwd()
            process = process.parent()
    return None


# The commands that run accelerate's launcher: its own (the console script, `python -m accelerate.commands.launch`),
# and accelerate's CLI (the console script, `python -m accelerate.commands.accelerate_cli`) followed by `launch`.
LAUNCH_COMMANDS = ("accelerate-launch", "accelerate.commands.launch")
CLI_COMMANDS = ("accelerate", "accelerate.commands.accelerate_cli")


def launch_options(argv: list[str]) -> list[str] | None:
    """The arguments after `accelerate launch` in a command line (the script and its own arguments included);
    None for any other command line."""
    names = [os.path.basename(arg) for arg in argv]
    starts = [index + 2 for index, name in enumerate(names[:-1]) if name in CLI_COMMANDS and names[index + 1]
              == "launch"] + [index + 1 for index, name in enumerate(names) if name in LAUNCH_COMMANDS]
    return argv[min(starts):] if starts else None


@dataclass(frozen=True)
class LauncherRequest:
    """What one `accelerate launch` command line asked, after accelerate filled it from the config file."""

    config_file: str = ""  # as its command line names it; accelerate's default config where it names none, else ''
    config_path: str = ""  # the file accelerate reads: config_file resolved against the launcher's directory
    distributed_type: str = ""  # the config file's (NO, MULTI_GPU, DEEPSPEED, FSDP, ...); '' without one
    num_processes: int = 1
    cpu: bool = False  # --cpu: the launcher starts the script once
    mixed_precision: str = "no"  # what it exports as ACCELERATE_MIXED_PRECISION
    precision_source: str = ""  # "flag" (its --mixed_precision), "config" (the file's), "" (its default, no)
    # The parallelism sizes its command line gave (other than 1), and whether it exports any parallelism size.
    sizes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    exports_parallelism: bool = False
    engine: str = ""  # "DeepSpeed" or "FSDP" where the config file's distributed_type names one

    @classmethod
    def of_options(cls, options: list[str], cwd: str) -> LauncherRequest | None:
        """The request of `accelerate launch <options>` run in `cwd`; None where accelerate's launcher would refuse
        the command line (it did not start this process then)."""
        from accelerate.commands.config.config_args import default_config_file
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser

        try:
            args = launch_command_parser().parse_args(options)
        except SystemExit:
            return None
        given = set(getattr(args, "nondefault", ()))
        named = args.config_file  # as its command line names it, for the messages
        if args.config_file:
            args.config_file = os.path.join(cwd, args.config_file)
        logging.getLogger("accelerate.commands.launch").setLevel(logging.ERROR)  # its notes on defaults it fills
        try:
            args, defaults, from_config = _validate_launch_command(args)
        except (ValueError, TypeError, KeyError, OSError):
            return None
        sizes = {name: int(getattr(args, f"parallelism_config_{name}_size")) for name in PARALLELISM_SIZES
                 if f"parallelism_config_{name}_size" in given}
        source = "flag" if "mixed_precision" in given else "config" if from_config else ""
        # Without a config file or --num_processes accelerate fills in this machine's GPU count, which no one
        # asked for (and which --cpu's one process ignores); a config file always sets it (accelerate refuses one
        # without it, distributed_type NO's 1 aside).
        asked = int(args.num_processes or 1) if "num_processes" in given or defaults is not None else 1
        kind = str(getattr(defaults, "distributed_type", "")).rsplit(".", 1)[-1].upper()
        return cls(config_file=named or (default_config_file if defaults is not None else ""),
                   config_path=args.config_file or (default_config_file if defaults is not None else ""),
                   distributed_type=kind, num_processes=asked, cpu=bool(args.cpu),
                   mixed_precision=str(args.mixed_precision).lower(), precision_source=source,
                   sizes=MappingProxyType({name: size for name, size in sizes.items() if size != 1}),
                   exports_parallelism=bool(args.use_parallelism_config),
                   engine={"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP"}.get(kind, ""))


def this_launcher() -> LauncherRequest | None:
    """The request of the `accelerate launch` this process runs under; None without one."""
    found = launcher_command()
    if found is None:
        return None
    argv, cwd = found
    return LauncherRequest.of_options(launch_options(argv) or [], cwd)


def launcher_problems(launcher: LauncherRequest, world_size: int, strategy: str) -> list[str]:
    """One line per setting the launcher was given and did not pass on to this run. `world_size`: the processes
    the run has (WORLD_SIZE); `strategy`: what the run trains as, in words (LaunchDescription.description)."""
    problems = []
    config = launcher.config_file or "no config file"
    if launcher.sizes and not launcher.exports_parallelism:
        given = " ".join(f"--parallelism_config_{name}_size {size}" for name, size in launcher.sizes.items())
        configs = "; ".join(dict.fromkeys(f"{name}_size: {SUPPORTING_CONFIG[name]}" for name in launcher.sizes))
        problems.append(f"accelerate launch {given} reaches no process: accelerate passes parallelism sizes on only "
                        f"from a config file with a parallelism_config section, and {config} has none, so the run "
                        f"would train {strategy} without them. Launch a config that applies them ({configs}).")
    count = f"--num_processes {launcher.num_processes}"
    script = script_shown()
    if launcher.cpu and (launcher.engine or launcher.num_processes > 1):
        # Under --cpu accelerate's launcher runs its simple launcher whatever the config's distributed_type says.
        without = f" without {config}'s {launcher.engine}" if launcher.engine else ""
        whatever = f", whatever {count} asks" if launcher.num_processes > 1 else ""
        problems.append(f"accelerate launch --cpu starts the script as one process{without}{whatever}: drop --cpu "
                        "and give the recipe --use_cpu true instead (accelerate launch "
                        f"--config_file {launcher.config_file or 'accelerate_configs/ddp.yaml'} {count} {script} "
                        "--use_cpu true).")
    elif launcher.num_processes > 1 and world_size == 1:
        why = (f"{config} runs one process (distributed_type {launcher.distributed_type})" if launcher.config_file else
               "without a config file accelerate starts several processes only on a machine with several GPUs")
        problems.append(f"accelerate launch {count} started one process: {why}. Give it a config: accelerate "
                        f"launch --config_file accelerate_configs/ddp.yaml {count} {script} (on CPU with the "
                        "recipe's --use_cpu true).")
    return problems


# The recipe's precision is the one applied, as a transformers or TRL script's own bf16/fp16 win over the
# launcher's (TrainingArguments.__post_init__ overwrites accelerate's ACCELERATE_MIXED_PRECISION with them): a
# recipe always states one. The launcher's flag, given for this run, is refused where it disagrees; a config
# file's value, written for every recipe launched with it, gets a note.


def check_launcher_precision(recipe: Recipe, asked: str | None, source: str | None) -> None:
    """`accelerate launch --mixed_precision X` that disagrees with the recipe's precision: it would not act.
    `asked`, `source`: LaunchDescription.launcher_precision and launcher_precision_source."""
    if source == "flag" and asked != recipe.mixed_precision:
        raise ConfigError(f"accelerate launch --mixed_precision {asked} and the recipe's --mixed_precision "
                          f"{recipe.mixed_precision} disagree, and the recipe's would be applied: give the recipe "
                          f"--mixed_precision {asked} (after the script) and drop the launcher's flag.")


def launcher_precision_note(recipe: Recipe, asked: str | None, source: str | None) -> str | None:
    """The note for a config file's mixed_precision other than the recipe's, which is applied; None otherwise."""
    if source != "config" or asked == recipe.mixed_precision:
        return None
    training = ("without mixed precision (no, " if recipe.mixed_precision == "no" else
                f"in {recipe.mixed_precision} (")
    return (f"training {training}the recipe's --mixed_precision), not the accelerate config's "
            f"mixed_precision {asked}: the recipe's precision wins, as a TrainingArguments script's bf16/fp16 do "
            f"(give --mixed_precision {asked} to train in it).")


def check_started_by_launcher(uses_deepspeed: bool) -> None:
    """DeepSpeed's engine needs the process group a launcher's variables describe: without WORLD_SIZE,
    accelerate's state asks torch.distributed for a world size no one initialized (a traceback)."""
    if uses_deepspeed and "WORLD_SIZE" not in os.environ:
        raise ConfigError("ACCELERATE_USE_DEEPSPEED=true is set but no launcher started this process (WORLD_SIZE "
                          "is unset): start DeepSpeed runs with accelerate launch --config_file "
                          "accelerate_configs/ds_zero3.yaml (or another ds_*.yaml) recipes/<recipe>.py ..., or "
                          "unset ACCELERATE_USE_DEEPSPEED to train one process without it.")

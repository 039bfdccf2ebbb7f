"""Compile the DeepSpeed ops the shipped accelerate configs need, of those this machine's DeepSpeed accelerator has,
once per machine (they land in ~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), and name each one: CPU Adam
(an optimizer offloaded to cpu or nvme), async I/O (NVMe offload) and, on the CPU accelerator, the shared-memory
collectives every DeepSpeed run on CPU loads. The CUDA accelerator has no shared-memory op: it is named, not built.
--config builds only what the given configs load (`make demo`: the shared-memory op alone, 42 s on 2 idle cores,
where all of them take minutes).

    python scripts/build_deepspeed_ops.py
    python scripts/build_deepspeed_ops.py --config accelerate_configs/ds_zero3.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from shardtune.checks.command_line import OneLineParser
from shardtune.parallel.deepspeed_ops import op_builders
from shardtune.plan.strategy import CONFIGS_DIR, PlanError, read_accelerate_config


@dataclass(frozen=True)
class NeededOp:
    builder: str  # the op builder's class name, as DeepSpeed's accelerators list them
    configs: tuple[str, ...]  # the shipped configs that load it


def needed_ops(config_files: list[Path]) -> list[NeededOp]:
    """The ops DeepSpeed loads for these accelerate configs (and the DeepSpeed JSON files they name)."""
    users: dict[str, list[str]] = {"CPUAdamBuilder": [], "AsyncIOBuilder": [], "ShareMemCommBuilder": []}
    for path in config_files:
        for builder in op_builders(read_accelerate_config(str(path))):
            users[builder].append(path.stem)
    return [NeededOp(name, tuple(configs)) for name, configs in users.items() if configs]


def split_by_accelerator(ops: list[NeededOp], accelerator) -> tuple[list[tuple[NeededOp, object]], list[NeededOp]]:
    """(op, builder) for the ops `accelerator` (a DeepSpeed accelerator) has; the ops it has not."""
    present, absent = [], []
    for op in ops:
        builder = accelerator.create_op_builder(op.builder)
        if builder is None:
            absent.append(op)
        else:
            present.append((op, builder))
    return present, absent


def config_problems(config_files: list[Path]) -> list[str]:
    """Each given config that is missing or that the planner's reader refuses, in one line with its fix."""
    problems = []
    for path in config_files:
        if not path.is_file():
            problems.append(f"--config {str(path)!r} does not exist: give an accelerate config file, e.g. "
                            "accelerate_configs/ds_zero3.yaml.")
            continue
        try:
            read_accelerate_config(str(path))
        except PlanError as error:  # the reader's own refusals name their fix; a file it cannot parse gets one
            fix = ": give an accelerate config file." if str(error).startswith("Cannot read") else ""
            problems.append(f"--config {str(path)!r}: {error}{fix}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="build_deepspeed_ops.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", type=Path, metavar="YAML",
                        help="build only the ops this accelerate config loads (repeatable); default: every shipped "
                             "config in accelerate_configs/")
    parser.add_argument("--dry_run", action="store_true",
                        help="name the ops that would be built and for which configs, and compile nothing")
    args = parser.parse_or_exit(argv)  # --help answers before anything compiles
    config_files = args.config or sorted(Path(CONFIGS_DIR).glob("*.yaml"))
    problems = config_problems(config_files)
    for problem in problems:
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    ops = needed_ops(config_files)
    if not ops:
        names = [path.stem for path in config_files]
        print(f"no deepspeed op to build: {', '.join(names)} {'uses' if len(names) == 1 else 'use'} no DeepSpeed")
    present, absent = split_by_accelerator(ops, accelerator)
    for op in absent:
        print(f"deepspeed op {op.builder}: not part of the {accelerator._name} accelerator, nothing to build")
    for op, builder in present:
        users = ", ".join(op.configs)
        if not builder.is_compatible(verbose=False):
            print(f"deepspeed op {builder.NAME}: not compatible on this machine (for {users}); "
                  f"{'install libaio-dev' if op.builder == 'AsyncIOBuilder' else 'see DeepSpeed ds_report'}")
        elif args.dry_run:
            print(f"deepspeed op {builder.NAME}: would be built (for {users})")
        else:
            # Said before it compiles (seconds to minutes, silent): a line afterwards explains nothing of the wait.
            print(f"deepspeed op {builder.NAME}: loading, compiling it first if it is not built yet (for {users})",
                  flush=True)
            builder.load(verbose=False)
            print(f"deepspeed op {builder.NAME}: ready (for {users})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

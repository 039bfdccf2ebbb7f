"""Compile the DeepSpeed ops the shipped accelerate configs need, of those this machine's DeepSpeed accelerator has,
once per machine (they land in ~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR), and name each one: CPU Adam
(an optimizer offloaded to cpu or nvme), async I/O (NVMe offload) and, on the CPU accelerator, the shared-memory
collectives every DeepSpeed run on CPU loads. The CUDA accelerator has no shared-memory op: it is named, not built.

    python scripts/build_deepspeed_ops.py
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shardtune.cpu_threads import optimizer_steps_on_cpu
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config


@dataclass(frozen=True)
class NeededOp:
    builder: str  # the op builder's class name, as DeepSpeed's accelerators list them
    configs: tuple[str, ...]  # the shipped configs that load it


def needed_ops(config_files: list[Path]) -> list[NeededOp]:
    """The ops DeepSpeed loads for these accelerate configs (and the DeepSpeed JSON files they name)."""
    users: dict[str, list[str]] = {"CPUAdamBuilder": [], "AsyncIOBuilder": [], "ShareMemCommBuilder": []}
    for path in config_files:
        strategy = read_accelerate_config(str(path))
        if strategy.kind != "deepspeed":
            continue
        users["ShareMemCommBuilder"].append(path.stem)  # deepspeed.comm loads it where the accelerator has it
        if optimizer_steps_on_cpu(strategy):  # accelerate swaps the optimizer for DeepSpeedCPUAdam
            users["CPUAdamBuilder"].append(path.stem)
        if "nvme" in (strategy.offload_optimizer, strategy.offload_params):
            users["AsyncIOBuilder"].append(path.stem)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)  # no options: --help answers before anything compiles
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    ops = needed_ops(sorted(Path(CONFIGS_DIR).glob("*.yaml")))
    present, absent = split_by_accelerator(ops, accelerator)
    for op in absent:
        print(f"deepspeed op {op.builder}: not part of the {accelerator._name} accelerator, nothing to build")
    for op, builder in present:
        users = ", ".join(op.configs)
        if builder.is_compatible(verbose=False):
            builder.load(verbose=False)
            print(f"deepspeed op {builder.NAME}: ready (for {users})")
        else:
            print(f"deepspeed op {builder.NAME}: not compatible on this machine (for {users}); "
                  f"{'install libaio-dev' if op.builder == 'AsyncIOBuilder' else 'see DeepSpeed ds_report'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

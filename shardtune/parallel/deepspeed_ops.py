"""Which of DeepSpeed's compiled ops a launch loads, and which of them DeepSpeed will compile first. DeepSpeed
compiles an op the first time a run loads it (unless it was installed prebuilt), silently and for minutes on a few
cores: a launch says so in one line before, and `scripts/build_deepspeed_ops.py` builds them ahead."""

from __future__ import annotations

import os
import sys

from shardtune.parallel.cpu_threads import optimizer_steps_on_cpu
from shardtune.plan.strategy import Strategy


def op_builders(strategy: Strategy) -> tuple[str, ...]:
    """The op builders (DeepSpeed's class names) a run under `strategy` loads, where its accelerator has them."""
    if strategy.kind != "deepspeed":
        return ()
    builders = ["ShareMemCommBuilder"]  # deepspeed.comm loads it where the accelerator has it (the CPU one)
    if optimizer_steps_on_cpu(strategy):  # accelerate swaps the optimizer for DeepSpeedCPUAdam
        builders.append("CPUAdamBuilder")
    if "nvme" in (strategy.offload_optimizer, strategy.offload_params):
        builders.append("AsyncIOBuilder")
    return tuple(builders)


def unbuilt_ops(builders: tuple[str, ...]) -> list[str]:
    """The names of the ops among `builders` that DeepSpeed will compile when they load: neither installed prebuilt
    nor in torch's extensions folder (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/<python>_<device>)."""
    if not builders:
        return []
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    accelerator = get_accelerator()
    names = []
    for name in builders:
        builder = accelerator.create_op_builder(name)
        if builder is None or installed_ops.get(builder.name, False):
            continue  # not this accelerator's, or shipped built
        built = os.path.join(extensions_root(), builder.name, f"{builder.name}.so")
        if not os.path.isfile(built):
            names.append(builder.name)
    return names


def extensions_root() -> str:
    """The folder torch's cpp_extension builds ops in, as its `_get_build_directory` names it (which also creates
    it: looking must leave nothing behind)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    device = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
              f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{device}")


def compile_notice(strategy: Strategy, config_file: str | None) -> str | None:
    """The line a launch under `config_file` prints before DeepSpeed compiles ops it loads, or None when they are
    built."""
    names = unbuilt_ops(op_builders(strategy))
    if not names:
        return None
    return (f"DeepSpeed compiles its {', '.join(names)} op{'s' * (len(names) > 1)} before the first step (once per "
            f"machine, minutes on a few cores): to build {'them' if len(names) > 1 else 'it'} ahead, python "
            f"scripts/build_deepspeed_ops.py --config {config_file or '<the accelerate config>'}.")

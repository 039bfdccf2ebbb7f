"""shardtune: Accelerate recipes for fine-tuning Llama-class models with FSDP and DeepSpeed ZeRO.

A recipe needs two names, `from shardtune import Recipe, main`; they are imported on first use, so that importing
one submodule (the planner, the checkpoint markers) stays light."""

from __future__ import annotations

import logging
from typing import Any


class _UnloadableTorchaoKernels(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load ") and "torchao/_C" in message)


class _TorchaoEnumRegistrations(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (isinstance(registered, type) and registered.__module__.startswith("torchao."))


# transformers imports torchao in every process once it is installed, and the PyPI wheel's CUDA kernels (_C*.so)
# cannot load into a CPU torch: one warning per kernel and rank that torchao.optim (pure PyTorch) never needs.
logging.getLogger("torchao").addFilter(_UnloadableTorchaoKernels())
# torchao 0.18 registers two of its enums as pytree constants, which torch 2.13 deprecates with one warning each, in
# every rank: torchao's to change, nothing a user can act on.
logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumRegistrations())

PUBLIC = {"Recipe": "shardtune.config", "main": "shardtune.cli"}


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module 'shardtune' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(PUBLIC[name]), name)

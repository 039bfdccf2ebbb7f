"""shardtune: Accelerate recipes for fine-tuning Llama-class models with FSDP and DeepSpeed ZeRO.

A recipe needs two names, `from shardtune import Recipe, main`; they are imported on first use, so that importing
one submodule (the planner, the checkpoint markers) stays light."""

from __future__ import annotations

from typing import Any

PUBLIC = {"Recipe": "shardtune.config", "main": "shardtune.cli"}


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module 'shardtune' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(PUBLIC[name]), name)

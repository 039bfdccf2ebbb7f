"""shardtune: Accelerate recipes for fine-tuning Llama-class models with FSDP and DeepSpeed ZeRO."""

from shardtune.config import Recipe
from shardtune.trainer import main

__all__ = ["Recipe", "main"]

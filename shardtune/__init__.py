"""shardtune: Accelerate recipes for fine-tuning Llama-class models with FSDP and DeepSpeed ZeRO."""

from shardtune.cli import main
from shardtune.config import Recipe

__all__ = ["Recipe", "main"]

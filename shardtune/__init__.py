"""shardtune: Accelerate recipes for fine-tuning Llama-class models with FSDP and DeepSpeed ZeRO."""

r"""meta-llama/Llama-3.1-8B full fine-tune, BF16 with fp32 master weights and gradient checkpointing.

Launch (one node, 8xH100-80GB):
    accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml \
        recipes/llama8b.py --dataset data/train.jsonl
Memory: 8.03e9 parameters x 16 bytes / 8 GPUs = 16 GB of model states per GPU under FULL_SHARD, plus activations.
Tested: the trainer, configs and launch path on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama8b",
    model_name_or_path="meta-llama/Llama-3.1-8B",
    dataset="data/train.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=2,
    global_batch_size=64,
    learning_rate=1e-5,
    lr_scheduler_type="cosine",
    warmup_ratio=0.03,
    num_train_epochs=1,
    gradient_checkpointing=True,
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=200,
)

if __name__ == "__main__":
    main(RECIPE)

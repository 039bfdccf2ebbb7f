r"""meta-llama/Llama-3.1-405B full fine-tune, BF16 with fp32 master weights and gradient checkpointing.

Launch (16 nodes x 8xH100-80GB: add --num_machines 16 --num_processes 128 --machine_rank N --main_process_ip HOST):
    accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml \
        recipes/llama405b.py --dataset data/train.jsonl
Memory: 405.85e9 parameters x 16 bytes = 6.5 TB of model states: 101 GB per GPU on 64 GPUs (does not fit), 51 GB per
    GPU on 128 GPUs.
Tested: the trainer, configs and launch path on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama405b",
    model_name_or_path="meta-llama/Llama-3.1-405B",
    dataset="data/train.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=1,
    global_batch_size=128,
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

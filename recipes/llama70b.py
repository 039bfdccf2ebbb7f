r"""meta-llama/Llama-3.1-70B full fine-tune, BF16 with fp32 master weights and gradient checkpointing.

Launch (one node, 8xH100-80GB, about 1.8 TB host RAM):
    accelerate launch --config_file accelerate_configs/ds_zero3_cpu_offload.yaml \
        recipes/llama70b.py --dataset data/train.jsonl
Memory: 70.55e9 parameters x 22 bytes / 8 = 194 GB per GPU under ZeRO-3 alone: it does not fit 80 GB. Offloading
    optimizer states, gradient partitions and weights to CPU RAM needs 26 bytes per parameter of host RAM (1.8 TB
    per node, as DeepSpeed holds them; python -m shardtune.plan --model recipes/llama70b.py shows the split);
    otherwise use more nodes (fsdp_full_shard on 3+ nodes) or LoRA.
Tested: the trainer, configs and launch path on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama70b",
    model_name_or_path="meta-llama/Llama-3.1-70B",
    dataset="data/train.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=1,
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

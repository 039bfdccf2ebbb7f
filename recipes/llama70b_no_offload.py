r"""meta-llama/Llama-3.1-70B full fine-tune on one node without any offload: bf16 weights and gradients with no fp32
master (torchao's AdamW rounds each update to bf16 stochastically), Adam's states in 8 bits, gradient checkpointing.
What it trades (docs/training.md, "Optimizers"): no fp32 master copy, and Adam's moments quantized to 8 bits per
block of 256; llama70b.py keeps both whole and offloads the optimizer states to host RAM instead.

Launch (one node, 8xH100-80GB; every state on the GPUs, sharded by FSDP2):
    accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml \
        recipes/llama70b_no_offload.py --dataset data/train.jsonl
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama70b_no_offload.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): fsdp_full_shard, micro-batch 1 x accumulation 8, gradient
    checkpointing on, optimizer adamw_torch_8bit with bf16 stochastic rounding (no fp32 master): 68.7 GB of 69.9 GB
    usable per GPU, 141 GB of 1,800 GB usable host RAM per node.
Tested: the trainer, configs and launch path on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama70b_no_offload",
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
    optim="adamw_torch_8bit",
    bf16_stochastic_round=True,
    logging_steps=10,
    eval_steps=200,
)

if __name__ == "__main__":
    main(RECIPE)

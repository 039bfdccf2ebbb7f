r"""google/gemma-3-12b-pt's text model full fine-tune, BF16 with fp32 master weights and gradient checkpointing.

Launch (one node, 8xH100-80GB):
    accelerate launch --config_file accelerate_configs/fsdp_shard_grad_op.yaml \
        recipes/gemma3_12b.py --dataset data/train.jsonl
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/gemma3_12b.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): fsdp_shard_grad_op, micro-batch 1 x accumulation 8, gradient
    checkpointing on (selective): 67.6 GB of 69.9 GB usable per GPU, 47 GB of 1,800 GB usable host RAM per node.
Tested: the trainer, configs and launch path on CPU with the family's tiny model (tests/launch/test_families.py);
not yet run on this hardware.
The Hub checkpoint is an image-and-text model (model_type gemma3): save its text model alone to
models/gemma-3-12b-text first (docs/models.md).
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="gemma3_12b",
    model_name_or_path="models/gemma-3-12b-text",
    dataset="data/train.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=1,
    global_batch_size=64,
    learning_rate=1e-5,
    lr_scheduler_type="cosine",
    warmup_ratio=0.03,
    num_train_epochs=1,
    gradient_checkpointing=True,
    gradient_checkpointing_mode="selective",
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=200,
)

if __name__ == "__main__":
    main(RECIPE)

r"""meta-llama/Llama-3.2-1B full fine-tune, BF16 with fp32 master weights.

Launch (one node, 8xH100-80GB):
    accelerate launch --config_file accelerate_configs/ddp.yaml \
        recipes/llama1b.py --dataset data/train.jsonl
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama1b.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): ddp, micro-batch 4 x accumulation 2, gradient checkpointing
    off: 66.8 GB of 69.9 GB usable per GPU, 40 GB of 1,800 GB usable host RAM per node.
Tested: the trainer, configs and launch path on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama1b",
    model_name_or_path="meta-llama/Llama-3.2-1B",
    dataset="data/train.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=4,
    global_batch_size=64,
    learning_rate=2e-5,
    lr_scheduler_type="cosine",
    warmup_ratio=0.03,
    num_train_epochs=1,
    gradient_checkpointing=False,
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=200,
)

if __name__ == "__main__":
    main(RECIPE)

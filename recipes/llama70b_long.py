r"""meta-llama/Llama-3.1-70B full fine-tune on 131,072-token rows (the model's own limit), each sequence split over
the node's 8 GPUs, the optimizer states in host RAM.

The longest rows one 8xH100-80GB node trains 70B on (docs/plan-table.md): without the split 16,384 tokens.
Launch (one node, 8xH100-80GB):
    OMP_NUM_THREADS=$(python -m shardtune.parallel.cpu_threads --ranks_per_node 8 \
        accelerate_configs/ds_zero3_offload_optimizer_ulysses.yaml) \
    accelerate launch --config_file accelerate_configs/ds_zero3_offload_optimizer_ulysses.yaml \
        recipes/llama70b_long.py --dataset data/train.jsonl
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama70b_long.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): ds_zero3_offload_optimizer_ulysses, micro-batch 1 x
    accumulation 1, gradient checkpointing on: 56.9 GB of 69.9 GB usable per GPU, 1,416 GB of 1,800 GB usable host
    RAM per node.
Tested: the sequence split against one process on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama70b_long",
    model_name_or_path="meta-llama/Llama-3.1-70B",
    dataset="data/train.jsonl",
    max_seq_length=131072,
    per_device_train_batch_size=1,
    global_batch_size=8,
    learning_rate=1e-5,
    lr_scheduler_type="cosine",
    warmup_ratio=0.03,
    num_train_epochs=1,
    gradient_checkpointing=True,
    mixed_precision="bf16",
    logging_steps=1,
    eval_steps=50,
)

if __name__ == "__main__":
    main(RECIPE)

r"""meta-llama/Llama-3.1-8B full fine-tune on 131,072-token rows, each sequence split over the node's 8 GPUs.

Rows of 32k-128k tokens (reasoning traces, long documents, repositories) hold more activations than one GPU: the
sequence split (DeepSpeed Ulysses) gives each GPU 1/8 of every row's positions, and all of its positions for 1/8
of the attention heads around attention. A step is 8 rows, 1M tokens.

Launch (one node, 8xH100-80GB):
    accelerate launch --config_file accelerate_configs/ds_zero3_ulysses.yaml \
        recipes/llama8b_128k.py --dataset data/train.jsonl
Or context parallelism (torch's ring attention, GPUs only): --config_file accelerate_configs/fsdp_cp.yaml;
    python -m shardtune.plan --model recipes/llama8b_128k.py --config_file accelerate_configs/fsdp_cp.yaml
    --hardware 8xh100-80gb prints "forward/backward 59.1 GB (peak)" and "-> fits".
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama8b_128k.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): ds_zero3_ulysses, micro-batch 1 x accumulation 1, gradient
    checkpointing on (selective): 59.0 GB of 69.9 GB usable per GPU, 32 GB of 1,800 GB usable host RAM per node.
Tested: the sequence split and context parallelism against one process on CPU with the tiny model (make test); not
yet run on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama8b_128k",
    model_name_or_path="meta-llama/Llama-3.1-8B",
    dataset="data/train.jsonl",
    max_seq_length=131072,
    per_device_train_batch_size=1,
    global_batch_size=8,
    learning_rate=1e-5,
    lr_scheduler_type="cosine",
    warmup_ratio=0.03,
    num_train_epochs=1,
    gradient_checkpointing=True,
    gradient_checkpointing_mode="selective",
    mixed_precision="bf16",
    logging_steps=1,
    eval_steps=50,
)

if __name__ == "__main__":
    main(RECIPE)

r"""meta-llama/Llama-3.1-405B full fine-tune with tensor parallelism, BF16 with fp32 master weights and gradient
checkpointing: each layer split over the 8 GPUs of a node (FSDP2 + TP), FSDP2 sharding every GPU's slices over the
nodes, without offload. The sibling of recipes/llama405b.py (which offloads to local disks on 2 nodes) at its global
batch: 16 times the nodes, and no optimizer step over PCIe.

Launch (32 nodes x 8xH100-80GB: tp_size 8 within a node, dp_shard_size 32 over the nodes; on each node add
--machine_rank N --main_process_ip HOST, or use scripts/slurm/train.sbatch, which gives the sizes itself):
    accelerate launch --config_file accelerate_configs/fsdp_tp.yaml --num_machines 32 --num_processes 256 \
        --parallelism_config_dp_shard_size 32 recipes/llama405b_tp.py --dataset data/train.jsonl
Plan on 32x8xh100-80gb, from python -m shardtune.plan --model recipes/llama405b_tp.py --hardware 32x8xh100-80gb
    (scripts/plan_table.py --write keeps this current): fsdp_tp, micro-batch 1 x accumulation 4, gradient
    checkpointing on: 52.7 GB of 69.9 GB usable per GPU, 1,623 GB of 1,800 GB usable host RAM per node.
Tested: the trainer, configs and launch path on CPU with the tiny model (tp 2 x dp_shard 2, make test); not yet run
on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama405b_tp",
    model_name_or_path="meta-llama/Llama-3.1-405B",
    dataset="data/train.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=1,  # the residual stream and logits are whole on every GPU of a node under TP
    global_batch_size=128,  # micro x accumulation x nodes: the 8 GPUs of a node run the same rows
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

r"""meta-llama/Llama-3.1-405B full fine-tune, BF16 with fp32 master weights and gradient checkpointing.

Launch (2 nodes x 8xH100-80GB with local NVMe: add --num_machines 2 --num_processes 16 --machine_rank N
--main_process_ip HOST; without offload, python -m shardtune.plan --model recipes/llama405b.py says
"Without offload it fits on 64 nodes: fsdp_tp, micro-batch 2 x accumulation 1", with tensor parallelism; at
micro-batch 1 recipes/llama405b_tp.py fits on 32):
    OMP_NUM_THREADS=$(python -m shardtune.parallel.cpu_threads --ranks_per_node 8 \
        accelerate_configs/ds_zero3_nvme_offload.yaml) \
    accelerate launch --config_file accelerate_configs/ds_zero3_nvme_offload.yaml \
        recipes/llama405b.py --dataset data/train.jsonl --offload_nvme_path /local_nvme
Plan on 2x8xh100-80gb, from python -m shardtune.plan --model recipes/llama405b.py --hardware 2x8xh100-80gb
    (scripts/plan_table.py --write keeps this current): ds_zero3_nvme_offload, micro-batch 2 x accumulation 4,
    gradient checkpointing on: 48.1 GB of 69.9 GB usable per GPU, 1,679 GB of 1,800 GB usable host RAM per node.
Tested: the trainer, configs and launch path on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama405b",
    model_name_or_path="meta-llama/Llama-3.1-405B",
    dataset="data/train.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=2,
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

r"""Qwen/Qwen3-30B-A3B full fine-tune, BF16 with fp32 master weights.
A mixture of experts: 128 experts per layer, 8 routed per token.

Launch (one node, 8xH100-80GB; ZeRO-3 shards every expert with the rest, the optimizer states in host RAM, as
planned below):
    OMP_NUM_THREADS=$(python -m shardtune.parallel.cpu_threads --ranks_per_node 8 \
        accelerate_configs/ds_zero3_offload_optimizer.yaml) \
    accelerate launch --config_file accelerate_configs/ds_zero3_offload_optimizer.yaml \
        recipes/qwen3_30b_a3b.py --dataset data/train.jsonl
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/qwen3_30b_a3b.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): ds_zero3_offload_optimizer, micro-batch 1 x accumulation 8,
    gradient checkpointing off: 55.7 GB of 69.9 GB usable per GPU, 616 GB of 1,800 GB usable host RAM per node.
Tested: the trainer, configs, router loss and launch path on CPU with the family's tiny model
(tests/launch/test_moe.py); not yet run on this hardware.
The router's load-balancing loss is trained as transformers adds it (router_aux_loss_coef from config.json) and
logged apart (aux_loss, routed_tokens_per_expert in metrics.jsonl; docs/models.md).
Override any field from the command line, e.g. --learning_rate 5e-6 --max_steps 500.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="qwen3_30b_a3b",
    model_name_or_path="Qwen/Qwen3-30B-A3B",
    dataset="data/train.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=1,
    global_batch_size=64,
    learning_rate=1e-5,
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

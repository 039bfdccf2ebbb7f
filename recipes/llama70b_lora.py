r"""meta-llama/Llama-3.1-70B-Instruct LoRA (r=16 on every linear layer), the frozen bf16 base sharded by FSDP2.

Launch (one node, 8xH100-80GB):
    accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml \
        recipes/llama70b_lora.py --dataset data/chat.jsonl
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama70b_lora.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): fsdp_full_shard, micro-batch 4 x accumulation 2, gradient
    checkpointing on: 53.7 GB of 69.9 GB usable per GPU, 141 GB of 1,800 GB usable host RAM per node.
Tested: the LoRA path on DDP, FSDP and ZeRO-3 on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --lora_r 64 --learning_rate 1e-4. Merge: scripts/merge_lora.py.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama70b_lora",
    model_name_or_path="meta-llama/Llama-3.1-70B-Instruct",
    dataset="data/chat.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=4,
    global_batch_size=64,
    packing=True,
    attn_implementation="flex_attention",  # per-sequence attention in a packed row without a dense mask
    use_peft=True,  # LoRA r=16, alpha 32, dropout 0.05 on all linear layers (the defaults)
    learning_rate=1e-4,
    gradient_checkpointing=True,
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=200,
)

if __name__ == "__main__":
    main(RECIPE)

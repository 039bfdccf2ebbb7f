r"""meta-llama/Llama-3.1-70B-Instruct DPO with LoRA (r=16 on every linear layer): the reference is the frozen bf16
base with the adapter switched off, so no second model is held.

Settings: alignment-handbook's zephyr-7b-dpo-qlora (beta 0.01, learning rate 5e-6, cosine with 10% warmup, 128 pairs
a step, 1,024 tokens a sequence), on trl-lib/ultrafeedback_binarized (chosen and rejected chats, prompt implied).
Launch (one node, 8xH100-80GB):
    accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml recipes/llama70b_dpo_lora.py
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama70b_dpo_lora.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): fsdp_full_shard, micro-batch 8 x accumulation 2, gradient
    checkpointing on: 54.2 GB of 69.9 GB usable per GPU, 141 GB of 1,800 GB usable host RAM per node.
Tested: DPO's step, losses and reference modes on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --beta 0.1 --lora_r 64. Merge: scripts/merge_lora.py. See docs/dpo.md.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama70b_dpo_lora",
    method="dpo",
    model_name_or_path="meta-llama/Llama-3.1-70B-Instruct",
    dataset="trl-lib/ultrafeedback_binarized",
    eval_split="test",
    max_seq_length=1024,
    per_device_train_batch_size=8,
    global_batch_size=128,
    use_peft=True,  # LoRA r=16, alpha 32, dropout 0.05 on all linear layers (the defaults); reference: adapter off
    beta=0.01,
    learning_rate=5e-6,
    lr_scheduler_type="cosine",
    warmup_ratio=0.1,
    num_train_epochs=1,
    gradient_checkpointing=True,
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=100,
)

if __name__ == "__main__":
    main(RECIPE)

r"""meta-llama/Llama-3.1-8B-Instruct full DPO (preference pairs), BF16 with fp32 master weights, a live bf16 reference.

Settings: alignment-handbook's zephyr-7b-dpo-full (beta 0.01, learning rate 5e-7, cosine with 10% warmup, 128 pairs
a step, 1,024 tokens a sequence), on trl-lib/ultrafeedback_binarized (chosen and rejected chats, prompt implied).
Launch (one node, 8xH100-80GB):
    accelerate launch --config_file accelerate_configs/ds_zero2.yaml recipes/llama8b_dpo.py
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama8b_dpo.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): ds_zero2, micro-batch 1 x accumulation 16, gradient
    checkpointing off: 65.5 GB of 69.9 GB usable per GPU, 257 GB of 1,800 GB usable host RAM per node.
Tested: DPO's step, losses and reference modes on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --beta 0.1 --precompute_ref_log_probs true. See docs/dpo.md.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama8b_dpo",
    method="dpo",
    model_name_or_path="meta-llama/Llama-3.1-8B-Instruct",
    dataset="trl-lib/ultrafeedback_binarized",
    eval_split="test",
    max_seq_length=1024,
    per_device_train_batch_size=1,
    global_batch_size=128,
    beta=0.01,
    learning_rate=5e-7,
    lr_scheduler_type="cosine",
    warmup_ratio=0.1,
    num_train_epochs=1,
    gradient_checkpointing=False,
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=100,
)

if __name__ == "__main__":
    main(RECIPE)

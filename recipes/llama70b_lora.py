r"""meta-llama/Llama-3.1-70B-Instruct LoRA (r=16 on every linear layer), the frozen bf16 base sharded by ZeRO-3.

Launch (one node, 8xH100-80GB):
    accelerate launch --config_file accelerate_configs/ds_zero3.yaml \
        recipes/llama70b_lora.py --dataset data/chat.jsonl
Memory: 207M trainable parameters; the bf16 base (141 GB) sharded over 8 GPUs, 17.7 GB each: 36 GB per GPU
    in all by the planner (python -m shardtune.plan --model recipes/llama70b_lora.py --hardware 8xh100-80gb
    --config_file accelerate_configs/ds_zero3.yaml). Under DDP the unsharded base alone would not fit.
Tested: the LoRA path on DDP, FSDP and ZeRO-3 on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --lora_r 64 --learning_rate 1e-4. Merge: scripts/merge_lora.py.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama70b_lora",
    model_name_or_path="meta-llama/Llama-3.1-70B-Instruct",
    dataset="data/chat.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=1,
    global_batch_size=64,
    packing=True,
    use_peft=True,  # LoRA r=16, alpha 32, dropout 0.05 on all linear layers (the defaults)
    learning_rate=1e-4,
    gradient_checkpointing=True,
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=200,
)

if __name__ == "__main__":
    main(RECIPE)

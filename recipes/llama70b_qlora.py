r"""meta-llama/Llama-3.1-70B-Instruct QLoRA: the frozen base in 4-bit NF4 (bitsandbytes), LoRA r=16 in bf16/fp32.

Launch (one node, 8xH100-80GB; data parallel, every GPU holds the whole 4-bit base):
    pip install bitsandbytes
    accelerate launch --config_file accelerate_configs/ddp.yaml \
        recipes/llama70b_qlora.py --dataset data/chat.jsonl
Needs CUDA GPUs: on a machine without one the recipe stops at start-up with a message, before loading anything.
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama70b_qlora.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): ddp, micro-batch 2 x accumulation 4, gradient checkpointing
    on: 66.9 GB of 69.9 GB usable per GPU, 331 GB of 1,800 GB usable host RAM per node.
Tested: the start-up refusal on CPU (make test); the 4-bit path has not run yet (no GPU was available).
Override any field from the command line, e.g. --lora_r 64. Merge: scripts/merge_lora.py (into a 16-bit base).
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama70b_qlora",
    model_name_or_path="meta-llama/Llama-3.1-70B-Instruct",
    dataset="data/chat.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=2,
    global_batch_size=64,
    packing=True,
    attn_implementation="flex_attention",  # per-sequence attention in a packed row without a dense mask
    use_peft=True,  # LoRA r=16, alpha 32, dropout 0.05 on all linear layers (the defaults)
    load_in_4bit=True,
    learning_rate=1e-4,
    gradient_checkpointing=True,
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=200,
)

if __name__ == "__main__":
    main(RECIPE)

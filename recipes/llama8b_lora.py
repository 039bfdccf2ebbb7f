r"""meta-llama/Llama-3.1-8B-Instruct LoRA (r=16 on every linear layer) on chat or instruction data, packed.

Launch (one node, 8xH100-80GB; data parallel, every GPU holds the frozen bf16 base):
    accelerate launch --config_file accelerate_configs/ddp.yaml \
        recipes/llama8b_lora.py --dataset data/chat.jsonl
Data: rows with `messages` (rendered with the model's chat template, loss on assistant turns), `prompt`/`completion`
    or `text`; sequences packed best-fit decreasing into rows of 4,096 tokens (--packing_strategy bfd, TRL's),
    attention isolated per sequence.
Plan on 8xh100-80gb, from python -m shardtune.plan --model recipes/llama8b_lora.py --hardware 8xh100-80gb
    (scripts/plan_table.py --write keeps this current): ddp, micro-batch 1 x accumulation 8, gradient checkpointing
    off: 46.1 GB of 69.9 GB usable per GPU, 128 GB of 1,800 GB usable host RAM per node.
Tested: the LoRA path on DDP, FSDP and ZeRO-3 on CPU with the tiny model (make test); not yet run on this hardware.
Override any field from the command line, e.g. --lora_r 64 --learning_rate 1e-4. Merge: scripts/merge_lora.py.
"""

from shardtune import Recipe, main

RECIPE = Recipe(
    name="llama8b_lora",
    model_name_or_path="meta-llama/Llama-3.1-8B-Instruct",
    dataset="data/chat.jsonl",
    max_seq_length=4096,
    per_device_train_batch_size=1,
    global_batch_size=64,
    packing=True,
    packing_strategy="bfd",  # a micro-batch of one row: joining a micro-batch's rows would pack nothing
    attn_implementation="flex_attention",  # per-sequence attention in a packed row without a dense mask
    use_peft=True,  # LoRA r=16, alpha 32, dropout 0.05 on all linear layers (the defaults)
    learning_rate=2e-4,
    gradient_checkpointing=False,
    mixed_precision="bf16",
    logging_steps=10,
    eval_steps=200,
)

if __name__ == "__main__":
    main(RECIPE)

"""Compare the planner's per-GPU peak with torch.cuda.max_memory_allocated on one GPU.

    python scripts/check_memory_gpu.py [--json]

Each case builds a randomly initialised Llama-shaped model from a config (no download), trains 3 steps with
AdamW in the trainer's precision modes (fp32 weights with bf16 autocast, as DDP runs) and prints planned vs
measured bytes. Needs CUDA; prints one line and exits 1 without it.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from shardtune.flops import shape_from_config
from shardtune.hardware import Hardware
from shardtune.plan import Strategy, plan

CASES = [  # (name, hidden, intermediate, layers, heads, kv heads, vocab, micro-batch, sequence, checkpointing)
    ("llama-0.5b", 1024, 4096, 16, 16, 8, 128256, 2, 2048, False),
    ("llama-0.5b", 1024, 4096, 16, 16, 8, 128256, 4, 2048, True),
    ("llama-1.2b", 2048, 8192, 16, 32, 8, 128256, 2, 4096, True),
    ("llama-1.2b", 2048, 8192, 16, 32, 8, 128256, 1, 4096, False),
]


def measure(config: LlamaConfig, micro: int, seq: int, checkpointing: bool) -> int:
    torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").cuda()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):  # the peak comes after the first step, once Adam's states exist
        input_ids = torch.randint(0, config.vocab_size, (micro, seq), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_memory_gpu: error: no CUDA device; run it on a GPU machine.")
    hardware = Hardware(1, 1, torch.cuda.get_device_properties(0).total_memory, name="1 GPU")
    rows = []
    for name, hidden, inter, layers, heads, kv, vocab, micro, seq, checkpointing in CASES:
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             max_position_embeddings=seq, tie_word_embeddings=False)
        planned = plan(shape_from_config(config, name), hardware, Strategy("ddp", "ddp", 0), micro, seq,
                       checkpointing).per_gpu["total"]
        measured = measure(config, micro, seq, checkpointing)
        rows.append({"case": f"{name} b{micro} s{seq} ckpt={checkpointing}", "planned_gb": planned / 1e9,
                     "measured_gb": measured / 1e9, "error": planned / measured - 1})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'case':<38}{'planned GB':>12}{'measured GB':>13}{'error':>9}")
    for row in rows:
        print(f"{row['case']:<38}{row['planned_gb']:>12.2f}{row['measured_gb']:>13.2f}{row['error']:>+9.1%}")


if __name__ == "__main__":
    main()

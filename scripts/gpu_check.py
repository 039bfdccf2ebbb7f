"""The one command that proves the trainer on a GPU: `make gpu-check` (or `python scripts/gpu_check.py`).

It makes a randomly initialised model of Llama-3.2-1B's shape (1.24B parameters, bf16 on disk, as Hub
checkpoints are) and a synthetic text file, both local: nothing is downloaded. It then trains it through
`accelerate launch --num_processes 1` with the shipped DDP, FSDP FULL_SHARD (4 micro-batches per step) and
ZeRO-3 configs, bf16, gradient checkpointing on, padded (SDPA) and packed (flex attention), and prints one table:
tokens/s per GPU, MFU, step time, and `torch.cuda.max_memory_allocated` against the planner's peak per case.

Exit 0 when every case trained and every planned peak is within 10% of the measured one; 1 otherwise; 2 without
a CUDA device. Sized for under 8 minutes on one H100 or H200.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = [  # (accelerate config, micro-batches per step, packing)
    ("ddp", 1, False), ("ddp", 1, True),
    ("fsdp_full_shard", 4, False), ("fsdp_full_shard", 4, True),
    ("ds_zero3", 1, False), ("ds_zero3", 1, True),
]
# Llama-3.2-1B's shape (MISSION.md), at a length and micro-batch that keep each case well under a minute.
MODEL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192)
SEQ, MICRO, STEPS, LOG_EVERY = 2048, 4, 8, 2
TOLERANCE = 0.10


def write_assets(root: Path) -> tuple[str, str]:
    """The model (random weights, saved in bf16) with the tiny character tokenizer, and text rows of 1/2 to 1 x
    SEQ characters (one token each), so that padded batches really pad."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)
    with torch.device("cuda"):  # initialising 1.2B parameters on the CPU takes minutes
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    del model
    torch.cuda.empty_cache()
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as file:
        for _ in range(400):
            length = rng.randint(SEQ // 2, SEQ - 2)
            file.write(json.dumps({"text": "".join(rng.choices(string.ascii_lowercase + " ", k=length))}) + "\n")
    return str(root / "model"), str(root / "data.jsonl")


def run_case(config: str, accumulation: int, packing: bool, assets: tuple[str, str], root: Path) -> dict:
    name = f"{config} {'packed' if packing else 'padded'} x{accumulation}"
    output_dir = root / name.replace(" ", "-")
    command = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
        str(REPO / "accelerate_configs" / f"{config}.yaml"), "--num_processes", "1", "--num_machines", "1",
        "--main_process_port", "29555", str(REPO / "recipes" / "tiny.py"),
        "--model_name_or_path", assets[0], "--dataset", assets[1], "--output_dir", str(output_dir),
        "--max_seq_length", str(SEQ), "--per_device_train_batch_size", str(MICRO),
        "--global_batch_size", str(MICRO * accumulation), "--max_steps", str(STEPS), "--logging_steps",
        str(LOG_EVERY), "--learning_rate", "1e-5", "--mixed_precision", "bf16", "--gradient_checkpointing", "true",
        "--packing", str(packing).lower(), "--attn_implementation", "flex_attention" if packing else "sdpa",
        "--eval_fraction", "0.02", "--per_device_eval_batch_size", "1", "--save_steps", "0", "--save_model", "false",
        "--report_to", "none",
    ]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    row = {"case": name, "seconds": time.monotonic() - started, "planned_gb": planned_peak(config, packing) / 1e9}
    if result.returncode != 0:
        return {**row, "error": (result.stderr or result.stdout).strip().splitlines()[-1:]}
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "loss" in r and r["step"] > LOG_EVERY]  # the first window warms up
    measured = max(r["peak_memory_gb"] for r in rows if "peak_memory_gb" in r) * 2**30 / 1e9
    return {**row, "tokens_per_second_per_gpu": statistics.mean(r["tokens_per_second_per_device"] for r in timed),
            "mfu": statistics.mean(r.get("mfu", float("nan")) for r in timed),
            "step_time_s": statistics.median(r["step_time_s"] for r in timed), "measured_gb": measured,
            "error_vs_plan": row["planned_gb"] / measured - 1}


def planned_peak(config: str, packing: bool) -> float:
    import torch
    from transformers import LlamaConfig

    from shardtune.flops import shape_from_config
    from shardtune.hardware import Hardware
    from shardtune.plan.planner import plan
    from shardtune.plan.strategy import read_accelerate_config

    shape = shape_from_config(LlamaConfig(**MODEL), "llama-1.2b (random)")
    hardware = Hardware(1, 1, torch.cuda.get_device_properties(0).total_memory, name="1 GPU")
    strategy = read_accelerate_config(str(REPO / "accelerate_configs" / f"{config}.yaml"), mixed_precision="bf16")
    # A packed micro-batch is one row of MICRO sequences under flex attention: no padding, no dense mask.
    return plan(shape, hardware, strategy, MICRO, SEQ, checkpointing=True, attn="flash" if packing else "sdpa",
                packing=packing).per_gpu["total"]


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<26}{'tok/s/GPU':>11}{'MFU':>7}{'step s':>8}{'peak GB':>9}{'planned':>9}{'error':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['case']:<26} FAILED: {' '.join(row['error'])}")
            continue
        print(f"{row['case']:<26}{row['tokens_per_second_per_gpu']:>11,.0f}{row['mfu']:>7.1%}"
              f"{row['step_time_s']:>8.2f}{row['measured_gb']:>9.1f}{row['planned_gb']:>9.1f}"
              f"{row['error_vs_plan']:>+8.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device is visible; run `make gpu-check` on a GPU machine.", file=sys.stderr)
        return 2
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, {len(CASES)} cases", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        root = Path(scratch)
        assets = write_assets(root)
        rows = []
        for config, accumulation, packing in CASES:
            rows.append(run_case(config, accumulation, packing, assets, root))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    failed = [row["case"] for row in rows if "error" in row or abs(row["error_vs_plan"]) > TOLERANCE]
    if failed:
        print(f"gpu_check: {len(failed)} case(s) failed or missed the plan by more than {TOLERANCE:.0%}: "
              f"{', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

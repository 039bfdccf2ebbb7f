"""Memory plan per GPU, before a single weight is loaded: model states, activations and buffers for any model x
hardware x accelerate config, and the fastest config, checkpointing and micro-batch that fit.

    python -m shardtune.plan --model llama-3.1-70b --hardware 8xh100-80gb                  # recommendation
    python -m shardtune.plan --model recipes/llama8b.py --config_file accelerate_configs/fsdp_full_shard.yaml
    python -m shardtune.plan --model llama-3.1-8b --compare --chart plan.png

All sizes are bytes. GB in output is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from shardtune.config import PLANNED_ATTENTION, below_lowest
from shardtune.flops import ModelError, recipe_fields, resolve_model
from shardtune.hardware import HardwareError, parse_hardware
from shardtune.plan.planner import plan
from shardtune.plan.report import format_compare, format_plan, write_chart
from shardtune.plan.search import config_paths, recommend
from shardtune.plan.states import Peft
from shardtune.plan.strategy import PlanError, read_accelerate_config


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtune.plan",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", required=True,
                        help="Built-in name, any Hugging Face model id (only its config.json is fetched), a local "
                             "model directory or config.json, or a recipe file")
    parser.add_argument("--hardware", default="8xh100-80gb",
                        help="e.g. 8xh100-80gb, 2x8xh100-80gb, 4x40gb (default: %(default)s)")
    parser.add_argument("--config_file", help="accelerate config YAML; without it, recommend one")
    parser.add_argument("--per_device_train_batch_size", type=int,
                        help="Micro-batch per GPU with --config_file or --compare (default: the recipe's, else 1); "
                             "a recommendation picks its own")
    parser.add_argument("--global_batch_size", type=int,
                        help="Sequences per optimizer step over all GPUs, for the recommendation's accumulation "
                             "(default: the recipe's)")
    parser.add_argument("--max_seq_length", type=int, help="Tokens per sequence (default: the recipe's, else 4096)")
    parser.add_argument("--gradient_checkpointing", type=_bool,
                        help="true or false, with --config_file or --compare (default: the recipe's, else true); a "
                             "recommendation picks its own")
    parser.add_argument("--mixed_precision", choices=("bf16", "fp16", "no"),
                        help="Training precision (default: the recipe's, else the accelerate config's; a "
                             "recommendation's: bf16)")
    parser.add_argument("--attn_implementation", default="sdpa", choices=tuple(PLANNED_ATTENTION),
                        help="Attention as the recipe's --attn_implementation: sdpa and eager hold a dense mask, "
                             "the flash kernels none (default: %(default)s)")
    parser.add_argument("--packing", type=_bool, default=False,
                        help="Padding-free packed micro-batches (one row of micro-batch x length tokens)")
    parser.add_argument("--host_ram_gb", type=float,
                        help="Host RAM per node in GB (default: 250 GB per GPU, as DGX nodes carry)")
    parser.add_argument("--use_peft", type=_bool, help="LoRA on a frozen base")
    parser.add_argument("--lora_r", type=int, help="LoRA rank, with --use_peft true (default: the recipe's, else 16)")
    parser.add_argument("--lora_target_modules", help="all-linear or comma-separated names")
    parser.add_argument("--load_in_4bit", type=_bool, help="QLoRA: the frozen base in 4-bit NF4")
    parser.add_argument("--compare", action="store_true", help="All accelerate_configs/*.yaml side by side")
    parser.add_argument("--chart", help="With --compare: write a stacked-bar PNG here")
    parser.add_argument("--json", action="store_true", help="Print the plan as one JSON object instead of a table")
    args = parser.parse_args(argv)
    problems = check_args(args)
    for problem in problems:
        print(f"shardtune.plan: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    try:
        return _run(args)
    except (PlanError, HardwareError, ModelError) as error:
        print(f"shardtune.plan: error: {error}", file=sys.stderr)
        return 2


def check_args(args: argparse.Namespace) -> list[str]:
    """Every impossible value, one line each, before anything is planned."""
    problems = below_lowest((f"--{name}", getattr(args, name)) for name in
                            ("per_device_train_batch_size", "global_batch_size", "max_seq_length", "lora_r"))
    if args.host_ram_gb is not None and not args.host_ram_gb > 0:
        problems.append(f"--host_ram_gb is host RAM per node in GB and must be > 0, got {args.host_ram_gb}.")
    peft_flags = [f"--{name}" for name in ("lora_r", "lora_target_modules", "load_in_4bit")
                  if getattr(args, name) is not None]
    if peft_flags and args.use_peft is not True and not args.model.endswith(".py"):
        problems.append(f"{', '.join(peft_flags)} shape{'s' if len(peft_flags) == 1 else ''} LoRA adapters: add "
                        "--use_peft true, or drop them.")
    if args.chart and not args.chart.lower().endswith(".png"):
        problems.append(f"--chart writes a PNG: give a path ending in .png, got {args.chart!r}.")
    if args.config_file and not os.path.isfile(args.config_file):
        problems.append(f"--config_file {args.config_file!r} does not exist: give an accelerate config YAML, e.g. "
                        "accelerate_configs/fsdp_full_shard.yaml.")
    return problems


def _given(value, fallback):
    return fallback if value is None else value


def _run(args: argparse.Namespace) -> int:
    hardware = parse_hardware(args.hardware, args.host_ram_gb)
    shape = resolve_model(args.model)
    recipe = recipe_fields(args.model) if args.model.endswith(".py") else {}
    seq = _given(args.max_seq_length, recipe.get("max_seq_length") or 4096)
    micro = _given(args.per_device_train_batch_size, recipe.get("per_device_train_batch_size") or 1)
    checkpointing = _given(args.gradient_checkpointing, recipe.get("gradient_checkpointing", True))
    precision = args.mixed_precision or recipe.get("mixed_precision")
    attn = PLANNED_ATTENTION[args.attn_implementation]
    packing = args.packing or recipe.get("packing", False)
    peft = None
    if _given(args.use_peft, recipe.get("use_peft", False)):
        peft = Peft(_given(args.lora_r, recipe.get("lora_r", 16)),
                    args.lora_target_modules or recipe.get("lora_target_modules", "all-linear"),
                    _given(args.load_in_4bit, recipe.get("load_in_4bit", False)))
        peft.trainable_params(shape)  # unknown target names: one line now
    if args.compare or args.chart:
        plans = [plan(shape, hardware, read_accelerate_config(path, precision), micro, seq, checkpointing, attn,
                      peft, packing) for path in config_paths()]
        if args.chart:
            write_chart(plans, args.chart)
        print(json.dumps([p.to_json() for p in plans]) if args.json else format_compare(plans))
        return 0
    if args.config_file:
        strategy = read_accelerate_config(args.config_file, precision)
        result = plan(shape, hardware, strategy, micro, seq, checkpointing, attn, peft, packing)
        print(json.dumps(result.to_json()) if args.json else format_plan(result))
        return 0 if result.fits else 1
    global_batch = _given(args.global_batch_size, recipe.get("global_batch_size"))
    found = recommend(shape, hardware, global_batch, seq, precision or "bf16", attn=attn, peft=peft, packing=packing)
    if args.json:
        body = found.plan.to_json() if found.plan else {"params": shape.params, "fits": False}
        print(json.dumps({**body, "recommendation": found.message, "gpu_only": found.gpu_only,
                          "accumulation": found.accumulation}))
    else:
        print(found.message)
        if found.plan:
            print(format_plan(found.plan))
    return 0 if found.plan else 1


if __name__ == "__main__":
    sys.exit(main())

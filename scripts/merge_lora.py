"""Merge a LoRA adapter (a --use_peft run's output_dir) into its base model and save a plain Hugging Face model.

    python scripts/merge_lora.py outputs/llama8b_lora merged/llama8b [--base meta-llama/Llama-3.1-8B] [--dtype bf16]

The base defaults to the one recorded in adapter_config.json. Merging is peft's `merge_and_unload`: W + B·A·α/r.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter_dir", help="a --use_peft run's output_dir (holding adapter_config.json)")
    parser.add_argument("output_dir", help="new directory for the merged Hugging Face model")
    parser.add_argument("--base", default="", help="Base model (default: adapter_config.json's)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="dtype of the merged weights (default: %(default)s)")
    args = parser.parse_args(argv)

    config_file = os.path.join(args.adapter_dir, "adapter_config.json")
    if not os.path.isfile(config_file):
        print(f"merge_lora: error: {config_file} not found: give the output_dir of a --use_peft run.", file=sys.stderr)
        return 2
    if os.path.exists(args.output_dir) and os.listdir(args.output_dir):
        print(f"merge_lora: error: {args.output_dir} is not empty; give a new directory.", file=sys.stderr)
        return 2
    with open(config_file) as file:
        base = args.base or json.load(file)["base_model_name_or_path"]

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, DTYPES[args.dtype]))
    merged = PeftModel.from_pretrained(model, args.adapter_dir).merge_and_unload()
    merged.save_pretrained(args.output_dir, safe_serialization=True, max_shard_size="5GB")
    tokenizer_source = args.adapter_dir if os.path.isfile(os.path.join(args.adapter_dir, "tokenizer_config.json")) \
        else base
    AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(args.output_dir)
    print(f"merge_lora: {base} + {args.adapter_dir} -> {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

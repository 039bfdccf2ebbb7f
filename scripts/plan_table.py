"""Print the README's plan table: for each model x hardware, the fastest accelerate config, checkpointing and
micro-batch that fit, with the planned peak per GPU and host RAM per node (python -m shardtune.plan logic).

    python scripts/plan_table.py --write    # replaces the table between the markers in README.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from shardtune.flops import resolve_model
from shardtune.hardware import parse_hardware
from shardtune.plan import recommend

README = Path(__file__).resolve().parents[1] / "README.md"
MODELS = {  # built-in name -> the global batch of its recipe
    "llama-3.2-1b": 64, "llama-3.2-3b": 64, "llama-3.1-8b": 64, "mistral-7b": 64, "qwen2.5-7b": 64,
    "llama-3.1-70b": 64, "llama-3.1-405b": 128,
}
HARDWARE = ("1xh100-80gb", "8xa100-40gb", "8xa100-80gb", "8xh100-80gb", "8xh200-141gb", "2x8xh100-80gb")
SEQ = 4096
HOST_RAM = 2e12  # a common 8xH100 node; offload plans needing more do not count as fitting


def table() -> str:
    header = ("model", "hardware", "config", "checkpointing", "micro-batch x accumulation", "peak per GPU",
              "host RAM per node")
    rows = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for model, global_batch in MODELS.items():
        shape = resolve_model(model)
        for name in HARDWARE:
            found = recommend(shape, parse_hardware(name), global_batch, SEQ, host_ram=HOST_RAM)
            if found.plan is None:
                rows.append(f"| {model} | {name} | nothing fits | | | | |")
                continue
            chosen = found.plan
            rows.append(f"| {model} | {name} | {chosen.config} | {'on' if chosen.gradient_checkpointing else 'off'} | "
                        f"{chosen.micro_batch} x {found.accumulation} | {chosen.per_gpu['total'] / 1e9:.1f} GB | "
                        f"{chosen.host_ram_per_node / 1e9:,.0f} GB |")
    return "\n".join(rows)


def readme_with_table(readme: str) -> str:
    start, end = "<!-- plan-table -->\n", "<!-- /plan-table -->"
    head, rest = readme.split(start)
    return head + start + table() + "\n" + end + rest.split(end)[1]


if __name__ == "__main__":
    if "--write" in sys.argv:
        README.write_text(readme_with_table(README.read_text()))
    else:
        print(table())

"""The planner's figures wherever the repository states them: the plan table of docs/plan-table.md, and each
recipe header's plan for the hardware it names. Written from shardtune.plan, checked by
tests/unit/plan/test_plan_launch.py.

    python scripts/plan_table.py            # print the table and every recipe's plan
    python scripts/plan_table.py --write    # rewrite them in docs/plan-table.md and recipes/*.py
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from shardtune.checks.command_line import OneLineParser
from shardtune.models.flops import resolve_config, resolve_model
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.planned_run import HELD_OPTIMIZER, planned_recipe, recipe_search
from shardtune.plan.planner import MemoryPlan
from shardtune.plan.report import checkpointing_words, optimizer_words
from shardtune.plan.search import Recommendation, Search, describe_plan, fewest_nodes, recommend
from shardtune.plan.strategy import read_accelerate_config

REPO = Path(__file__).resolve().parents[1]
TABLE_DOC = REPO / "docs" / "plan-table.md"
MODELS = {  # built-in name -> the global batch of its recipe
    "llama-3.2-1b": 64, "llama-3.2-3b": 64, "llama-3.1-8b": 64, "mistral-7b": 64, "qwen2.5-7b": 64,
    "llama-3.1-70b": 64, "llama-3.1-405b": 128, "qwen3-8b": 64, "qwen3-32b": 64, "gemma-3-12b": 64, "olmo-2-7b": 64,
    "smollm3-3b": 64, "granite-3.3-8b": 64, "qwen3-30b-a3b": 64, "mixtral-8x7b": 64,
}
HARDWARE = ("1xh100-80gb", "8xa100-40gb", "8xa100-80gb", "8xh100-80gb", "8xh200-141gb", "2x8xh100-80gb")
SEQ = 4096
HEADER_WIDTH = 116  # a recipe header's plan block, wrapped within ruff's line length
RECIPE_NODE = "8xh100-80gb"  # every model recipe is written for nodes of 8 H100-80GB
PLAN_BLOCK = re.compile(r"Plan on .*?(?=\nTested:)", re.DOTALL)  # the generated block of a recipe header


def checkpointing(chosen: MemoryPlan) -> str:
    return checkpointing_words(chosen.gradient_checkpointing, chosen.gradient_checkpointing_mode)


def table() -> str:
    header = ("model", "hardware", "config", "checkpointing", "optimizer", "micro-batch x accumulation",
              "peak per GPU", "host RAM per node")
    rows = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for model, global_batch in MODELS.items():
        shape = resolve_model(model)
        for name in HARDWARE:
            found = recommend(shape, parse_hardware(name), Search(global_batch, SEQ))
            if found.plan is None:
                rows.append(f"| {model} | {name} | nothing fits | | | | | |")
                continue
            chosen = found.plan
            rows.append(f"| {model} | {name} | {chosen.config} | {checkpointing(chosen)} | "
                        f"{optimizer_words(chosen.optim, chosen.bf16_stochastic_round)} | "
                        f"{chosen.micro_batch} x {found.accumulation} | {chosen.per_gpu['total'] / 1e9:.1f} GB | "
                        f"{chosen.host_ram_per_node / 1e9:,.0f} GB |")
    return "\n".join(rows)


# The longest rows on one node: lengths doubling from SEQ up to the model's own limit (max_position_embeddings),
# one row per GPU a step (the micro-batch 1, no accumulation: the length alone decides).
LONG_NODE = "8xh100-80gb"


def longest(model: str, split: bool) -> tuple[int, Recommendation] | None:
    """The longest length whose fastest plan on one LONG_NODE node needs no sequence split (`split` False), or
    that fits at all, the split allowed (the search tries it once nothing unsplit fits), with that plan."""
    shape, hardware = resolve_model(model), parse_hardware(LONG_NODE)
    found, length = None, SEQ
    while length <= resolve_config(model)[1].max_position_embeddings:
        chosen = recommend(shape, hardware, Search(hardware.world_size, length))
        if chosen.plan is None or (not split and "split" in chosen.plan.layout):
            break
        found, length = (length, chosen), length * 2
    return found


def longest_table() -> str:
    header = ("model", "longest without a split", "its plan", "longest with the split allowed", "its plan")
    rows = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for model in MODELS:
        cells = [model]
        for split in (False, True):
            found = longest(model, split)
            cells += [f"{found[0]:,}", f"{describe_plan(found[1].plan, found[1].accumulation)}, "
                      f"{found[1].plan.per_gpu['total'] / 1e9:.1f} GB"] if found else ["-", "nothing fits"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def with_block(doc: str, name: str, content: str) -> str:
    """`doc` with the generated block between <!-- name --> and <!-- /name --> replaced by `content`."""
    start, end = f"<!-- {name} -->\n", f"<!-- /{name} -->"
    head, rest = doc.split(start)
    return head + start + content + "\n" + end + rest.split(end)[1]


def doc_with_table(doc: str) -> str:
    """The page with its generated tables (the fastest plans; the longest rows on one node) replaced by the
    current ones."""
    return with_block(with_block(doc, "plan-table", table()), "longest-table", longest_table())


def recipe_plan(path: Path) -> tuple[int, Recommendation]:
    """The fastest plan for a recipe's own fields on the fewest RECIPE_NODE nodes that hold it: (nodes, plan); for
    a recipe that launches tensor parallelism, on the fewest that hold it without offload (its sibling offloads
    on fewer)."""
    recipe = planned_recipe(str(path), {})
    # The search varies micro-batch, checkpointing and its mode: the recipe's own must be what it finds fastest.
    hardware = parse_hardware(RECIPE_NODE)
    launched = re.search(r"--config_file\s+(\S+\.yaml)", path.read_text())
    tensor = bool(launched) and read_accelerate_config(str(REPO / launched.group(1))).tensor_parallel > 1
    found = fewest_nodes(resolve_model(str(path)), hardware,
                         recipe_search(recipe, hardware, recipe.mixed_precision, HELD_OPTIMIZER), gpu_only=tensor)
    if found is None:
        raise SystemExit(f"{path.name}: nothing fits on up to 64 nodes of {RECIPE_NODE}")
    return found


def plan_block(path: Path) -> str:
    nodes, found = recipe_plan(path)
    chosen = found.plan
    sentence = (f"(scripts/plan_table.py --write keeps this current): {describe_plan(chosen, found.accumulation)}: "
                f"{chosen.per_gpu['total'] / 1e9:.1f} GB of {chosen.capacity / 1e9:.1f} GB usable per GPU, "
                f"{chosen.host_ram_per_node / 1e9:,.0f} GB of {chosen.host_ram_capacity / 1e9:,.0f} GB usable host "
                "RAM per node.")
    return (f"Plan on {chosen.hardware}, from python -m shardtune.plan --model recipes/{path.name} --hardware "
            f"{chosen.hardware}\n" + textwrap.fill(sentence, HEADER_WIDTH, initial_indent="    ",
                                                   subsequent_indent="    ", break_on_hyphens=False))


def model_recipes() -> list[Path]:
    return sorted(path for path in (REPO / "recipes").glob("*.py") if path.name != "tiny.py")


def recipe_with_plan(path: Path) -> str:
    text = path.read_text()
    if not PLAN_BLOCK.search(text):
        raise SystemExit(f"{path.name}: no 'Plan on ...' block before 'Tested:' in its header")
    return PLAN_BLOCK.sub(lambda _: plan_block(path), text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--write", action="store_true",
                        help="Rewrite docs/plan-table.md's table and every recipe header's plan instead of "
                             "printing them")
    write = parser.parse_or_exit(argv).write
    if write:
        TABLE_DOC.write_text(doc_with_table(TABLE_DOC.read_text()))
    else:
        print(table())
    for recipe in model_recipes():
        if write:
            recipe.write_text(recipe_with_plan(recipe))
        else:
            print(f"\n{recipe.name}: {plan_block(recipe)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every recipe is declarative, named after its file, launchable with a shipped config, and overridable; its
header's figures are what the recipe's own --dry_run prints, every planner command it quotes prints what the
header says it does, and its prose names the strategy its launch line's config runs."""

from __future__ import annotations

import importlib.util
import re

import pytest

from shardtune.config import Recipe
from shardtune.flags import parse_recipe
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.strategy import Strategy, read_accelerate_config
from tests.conftest import CONFIGS, REPO
from tests.unit.documented_commands import agrees, outside_a_launch, run, same_sentence

RECIPES = sorted(path for path in (REPO / "recipes").glob("*.py") if path.stem != "tiny")
EXPECTED = {"llama1b", "llama3b", "llama8b", "llama70b", "llama70b_no_offload", "llama405b", "llama405b_tp",
            "mistral7b", "qwen2_5_7b", "qwen3_8b", "qwen3_32b", "gemma3_12b", "olmo2_7b",
            "llama8b_lora", "llama70b_lora", "llama70b_qlora", "llama8b_128k", "llama70b_long", "llama8b_dpo",
            "llama70b_dpo_lora", "qwen3_30b_a3b", "mixtral_8x7b"}


# The plan a header states (scripts/plan_table.py writes it), each figure as the header rounds it.
# A header's plan block, its whitespace collapsed to single spaces (scripts/plan_table.py wraps it).
HEADER_PLAN = re.compile(
    r"Plan on (?P<hardware>\S+), from python -m shardtune\.plan[^(]*\(scripts/plan_table\.py --write keeps this "
    r"current\): (?P<sentence>(?P<config>\w+), micro-batch (?P<micro>\d+) x accumulation (?P<accumulation>\d+),\s+"
    r"gradient checkpointing (?P<checkpointing>on \(selective\)|on|off)(?:,\s+optimizer (?P<optimizer>[^:]+))?: "
    r"(?P<gpu>[\d.,]+) GB of (?P<usable>[\d.,]+) GB usable per GPU,\s+(?P<host>[\d.,]+) GB "
    r"of (?P<host_usable>[\d.,]+) GB usable host RAM per node\.)")
HEADER_COMMAND = re.compile(r"python -m shardtune\.plan(?: --\w+ [^\s,;:)\"]+)+")
QUOTED = re.compile(r'"([^"]+)"')
LAUNCH_NODES = re.compile(r"^Launch \((?:one node|(\d+) nodes)", re.MULTILINE)
# What --dry_run prints (shardtune.plan.report.format_plan).
DRY_RUN_FIGURES = {
    "config": r" with (\w+), micro-batch", "micro": r"micro-batch (\d+) x \d+ tokens",
    "checkpointing": r"checkpointing (on \(selective\)|on|off),", "optimizer": r"optimizer (.+)$",
    "gpu": r"^\s+total\s+([\d.,]+) GB",
    "usable": r"^\s+usable\s+([\d.,]+) GB", "host": r"host RAM per node: ([\d.,]+) GB",
    "host_usable": r"host RAM per node: [\d.,]+ GB of ([\d.,]+) GB usable",
}
# Strategy words of a header's prose, and whether a config's strategy is what they name.
STRATEGY_WORDS = {
    r"ZeRO-(\d)": lambda strategy, stage: strategy.kind == "deepspeed" and strategy.shard == int(stage),
    r"\bFSDP2?\b": lambda strategy: strategy.kind == "fsdp",
    r"\bDDP\b|[Dd]ata parallel": lambda strategy: strategy.kind == "ddp",
    r"NVMe": lambda strategy: "nvme" in (strategy.offload_optimizer, strategy.offload_params),
    r"optimizer states in host RAM": lambda strategy: strategy.offload_optimizer == "cpu",
}


def header(path) -> str:
    return path.read_text().split('"""')[1]


def launch_config(path) -> str:
    return re.search(r"--config_file (accelerate_configs/\w+\.yaml)", header(path)).group(1)


def load(path) -> Recipe:
    spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RECIPE


def test_all_model_recipes_exist():
    assert {path.stem for path in RECIPES} == EXPECTED


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_recipe_declares_and_names_its_launch(path):
    recipe = load(path)
    assert recipe.name == path.stem and recipe.model_name_or_path
    assert recipe.mixed_precision == "bf16"  # checkpointing and micro-batch: test_every_recipe_follows_its_plan
    header = path.read_text().split('"""')[1]
    config = re.search(r"--config_file accelerate_configs/(\w+)\.yaml", header).group(1)
    assert (CONFIGS / f"{config}.yaml").is_file()
    assert f"recipes/{path.name}" in header
    assert parse_recipe(recipe, ["--max_steps", "5"]).max_steps == 5


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_header_plan_is_the_recipes_dry_run(path, tmp_path, monkeypatch):
    """The header's config, micro-batch, accumulation, checkpointing, GB per GPU and host RAM per node, and its
    node count, are what `python recipes/x.py --dry_run --hardware <the header's>` prints for its launch line."""
    outside_a_launch(monkeypatch)
    text = header(path)
    claimed = HEADER_PLAN.search(" ".join(text.split()))
    assert claimed, f"{path.name}: no 'Plan on ...' figures in its header (scripts/plan_table.py --write)"
    hardware = parse_hardware(claimed["hardware"])
    nvme = re.search(r"--offload_nvme_path \S+", text)  # the launch line's: a dry run checks it as the launch does
    code, printed = run([f"recipes/{path.name}", "--dry_run", "--hardware", claimed["hardware"],
                         *(nvme.group(0).split() if nvme else [])], tmp_path)
    assert code == 0, f"{path.name} --dry_run --hardware {claimed['hardware']} exits {code}:\n{printed}"
    wrong = []
    for name, pattern in DRY_RUN_FIGURES.items():
        found = re.search(pattern, printed, re.MULTILINE).group(1)
        numeric = name in ("gpu", "usable", "host", "host_usable")
        if name == "optimizer" and claimed[name] is None:  # the sentence names only an optimizer not the default
            claimed_value = "adamw_torch"
        else:
            claimed_value = claimed[name]
        if not (agrees(claimed_value, found) if numeric else claimed_value == found):
            wrong.append(f"{name}: header {claimed_value}, --dry_run {found}")
    recipe = load(path)
    # The data-parallel ranks: every GPU, or under tensor parallelism one per tp group.
    ranks = hardware.world_size // read_accelerate_config(str(REPO / launch_config(path))).tensor_parallel
    accumulation = recipe.global_batch_size // (int(claimed["micro"]) * ranks)
    if int(claimed["accumulation"]) != accumulation:
        wrong.append(f"accumulation: header {claimed['accumulation']}, the recipe's batch over the GPUs {accumulation}")
    launch_nodes = LAUNCH_NODES.search(text)
    if launch_nodes and int(launch_nodes.group(1) or 1) != hardware.nodes:
        wrong.append(f"nodes: 'Launch ({launch_nodes.group(0)[8:]}' against {claimed['hardware']}")
    assert not wrong, f"{path.name}'s header against its --dry_run:\n" + "\n".join(wrong) + f"\n{printed}"


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_header_planner_commands_print_what_the_header_says(path, tmp_path, monkeypatch):
    """Each `python -m shardtune.plan ...` of a header prints the plan sentence the header gives after it, or
    every "quoted" passage up to the next command (a header that cites the planner quotes what it prints)."""
    outside_a_launch(monkeypatch)
    text = " ".join(header(path).split())
    commands = list(HEADER_COMMAND.finditer(text))
    assert commands, f"{path.name}: its header quotes no planner command"
    for command, following in zip(commands, [*commands[1:], None], strict=True):
        claims = text[command.end():following.start() if following else len(text)]
        code, printed = run(command.group(0).split()[1:], tmp_path)
        assert code in (0, 1), f"{path.name}: {command.group(0)} is refused:\n{printed}"  # 1: nothing fits
        plan = HEADER_PLAN.search(f"Plan on x, from python -m shardtune.plan\n{claims}")
        assert plan or QUOTED.search(claims), (f"{path.name}: {command.group(0)} is cited with none of what it "
                                               f"prints: quote it\n{printed}")
        if plan:
            assert same_sentence(plan["sentence"], printed), (
                f"{path.name}: {command.group(0)} does not print {plan['sentence']!r}:\n{printed}")
        for quote in QUOTED.findall(claims):
            assert " ".join(quote.split()) in " ".join(printed.split()), (
                f"{path.name}: {command.group(0)} does not print {quote!r}:\n{printed}")


def strategy_words_wrong(prose: str, strategy: Strategy) -> list[str]:
    """The strategy words of `prose` that do not describe `strategy`."""
    wrong = []
    for pattern, describes in STRATEGY_WORDS.items():
        for match in re.finditer(pattern, prose):
            if not describes(strategy, *match.groups()):
                wrong.append(match.group(0))
    return wrong


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_header_prose_names_the_strategy_it_launches(path):
    """The header's own words (not its command lines, its generated plan or what the tests ran) say what the
    config of its launch line does: ZeRO-3 only under a ZeRO-3 config, FSDP under FSDP, data parallel under DDP."""
    prose = "\n".join(line for line in header(path).splitlines()
                      if line and not line[0].isspace() and not line.startswith(("Plan on", "Tested:")))
    strategy = read_accelerate_config(str(REPO / launch_config(path)))
    wrong = strategy_words_wrong(prose, strategy)
    assert not wrong, f"{path.name}: its header says {wrong}, its launch line runs {launch_config(path)}"


def test_readme_recipe_table_names_each_recipes_launch_config():
    """The README's recipe table gives each recipe's config (and node count): the one its header launches."""
    rows = re.findall(r"^\| `(recipes/\w+\.py)` \| [^|]+ \| `(\w+)`(?:, (\d+) nodes)? \|$",
                      (REPO / "README.md").read_text(), re.MULTILINE)
    assert {path for path, _, _ in rows} == {f"recipes/{name}.py" for name in EXPECTED}
    for path, config, nodes in rows:
        assert launch_config(REPO / path) == f"accelerate_configs/{config}.yaml", path
        launched = LAUNCH_NODES.search(header(REPO / path)).group(1)
        assert (nodes or None) == launched, path

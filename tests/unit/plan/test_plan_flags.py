"""The planner CLI plans the run it is given: every flag acts or is refused with one line, a recipe's fields are
the recipe's run, the recipe's refusals hold, and the compare table and chart show the same sums."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os

import pytest

from shardtune.checks.model import check_context_length
from shardtune.config import FIELD_CHOICES, LOSS_TILE_POSITIONS, ConfigError, Recipe
from shardtune.models.flops import resolve_config, resolve_model
from shardtune.plan import planned_run
from shardtune.plan.__main__ import RUN_FLAGS, add_run_flags, main
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.planner import plan
from shardtune.plan.report import PEAK_COMPONENTS, format_compare, peak_components, write_chart
from shardtune.plan.search import config_paths
from shardtune.plan.states import Peft
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config
from tests.conftest import REPO

H100 = parse_hardware("8xh100-80gb")
LORA_RECIPE = str(REPO / "recipes" / "llama8b_lora.py")
DDP = os.path.join(CONFIGS_DIR, "ddp.yaml")


def run_json(capsys, *argv: str) -> tuple[int, dict | list]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def refusal(capsys, *argv: str) -> str:
    """The one line a refused command prints; it must exit 2 and print nothing else."""
    code = main(list(argv))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and not captured.out, (code, captured)
    return lines[0]


def test_a_recommendation_keeps_the_micro_batch_and_checkpointing_given(capsys):
    code, found = run_json(capsys, "--model", "llama-3.1-8b", "--gradient_checkpointing", "true",
                           "--per_device_train_batch_size", "4")
    assert code == 0 and found["micro_batch"] == 4 and found["gradient_checkpointing"] is True
    assert found["micro_batch"] * found["accumulation"] * 8 == 64 or found["accumulation"] == 1
    assert found["held"] == ("Kept as given (--per_device_train_batch_size, --gradient_checkpointing): micro-batch 4 "
                             "and gradient checkpointing on; searched: the accelerate config and checkpointing mode "
                             "and optimizer.")
    # The mode given too: nothing but the config is searched.
    code, found = run_json(capsys, "--model", "llama-3.1-8b", "--gradient_checkpointing", "true",
                           "--gradient_checkpointing_mode", "full", "--per_device_train_batch_size", "4")
    assert code == 0 and found["gradient_checkpointing_mode"] == "full"
    assert found["held"].endswith("micro-batch 4 and gradient checkpointing on; searched: the accelerate config and "
                                  "optimizer.")
    # One of the two given: the other is searched, and the line says so.
    code, found = run_json(capsys, "--model", "llama-3.1-8b", "--global_batch_size", "64",
                           "--gradient_checkpointing", "true")
    assert code == 0 and found["gradient_checkpointing"] is True
    assert found["micro_batch"] * found["accumulation"] * 8 == 64
    assert found["held"].endswith("gradient checkpointing on; searched: the accelerate config and micro-batch and "
                                  "checkpointing mode and optimizer.")
    assert main(["--model", "llama-3.1-8b", "--per_device_train_batch_size", "4"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 4 x accumulation" in out.splitlines()[0]
    assert out.splitlines()[1].startswith("Launch: accelerate launch --config_file accelerate_configs/")
    assert out.splitlines()[2] == ("Kept as given (--per_device_train_batch_size): micro-batch 4; searched: the "
                                   "accelerate config and checkpointing and checkpointing mode and optimizer.")
    # A micro-batch that cannot keep the global batch is refused by the recipe's rule, before any search.
    line = refusal(capsys, "--model", "llama-3.1-8b", "--per_device_train_batch_size", "3", "--global_batch_size",
                   "64")
    assert "--global_batch_size 64 is not divisible by per_device_train_batch_size x processes = 3 x 8 = 24" in line


def test_a_recipe_recommendation_keeps_the_recipe_s_micro_batch_and_checkpointing(capsys):
    code, found = run_json(capsys, "--model", str(REPO / "recipes" / "llama70b.py"))
    assert code == 0 and (found["micro_batch"], found["gradient_checkpointing"]) == (1, True)
    assert found["gradient_checkpointing_mode"] == "selective"
    assert ("llama70b.py): micro-batch 1 and gradient checkpointing on (selective) and optimizer adamw_torch; "
            "searched: the accelerate config.") in found["held"]
    # A flag over the recipe's value is what is kept.
    code, found = run_json(capsys, "--model", str(REPO / "recipes" / "llama70b.py"), "--per_device_train_batch_size",
                           "2", "--gradient_checkpointing_mode", "full")
    assert (found["micro_batch"], found["accumulation"], found["gradient_checkpointing_mode"]) == (2, 4, "full")


@pytest.mark.parametrize("argv,names", [
    (["--model", "llama-3.1-8b", "--compare", "--config_file", DDP], "--compare plans every shipped config"),
    (["--model", "llama-3.1-8b", "--chart", "x.png", "--config_file", DDP], "--chart plans every shipped config"),
    (["--model", "llama-3.1-8b", "--config_file", DDP, "--global_batch_size", "64"],
     "--global_batch_size sets the recommendation's accumulation; the plan of --config_file"),
    (["--model", "llama-3.1-8b", "--compare", "--global_batch_size", "64"],
     "--global_batch_size sets the recommendation's accumulation; the plan of --compare"),
    (["--model", str(REPO / "recipes" / "llama8b.py"), "--lora_r", "8"], "--lora_r shapes LoRA adapters: add"),
    (["--model", LORA_RECIPE, "--use_peft", "false", "--load_in_4bit", "true"], "--load_in_4bit shapes LoRA"),
    (["--model", "llama-3.1-8b", "--packing", "true"], "--packing true with --attn_implementation sdpa"),
    (["--model", LORA_RECIPE, "--attn_implementation", "eager", "--config_file", DDP],
     "--packing true with --attn_implementation eager"),
    (["--model", "llama-3.1-8b", "--gradient_accumulation_steps", "4"],
     "--gradient_accumulation_steps: a model's recommendation searches the micro-batch"),
    (["--model", "llama-3.1-8b", "--global_batch_size", "64", "--gradient_accumulation_steps", "4"],
     "--gradient_accumulation_steps: a model's recommendation searches the micro-batch"),
    (["--model", str(REPO / "recipes" / "llama8b.py"), "--gradient_accumulation_steps", "3"],
     "--gradient_accumulation_steps 3 disagrees with --global_batch_size"),
    (["--model", str(REPO / "recipes" / "llama8b.py"), "--config_file", DDP, "--gradient_accumulation_steps", "3"],
     "--gradient_accumulation_steps 3 disagrees with --global_batch_size"),
    (["--model", "llama-3.1-8b", "--config_file", DDP, "--mixed_precision", "fp8", "--pad_to_multiple_of", "8"],
     "--pad_to_multiple_of 8 under --mixed_precision fp8"),
    (["--model", "llama-3.1-8b", "--pad_to_multiple_of", "0"], "--pad_to_multiple_of must be >= 1, got 0."),
    (["--model", LORA_RECIPE, "--activation_offloading", "true"], "a layer that is not recomputed saves its weights"),
])
def test_a_flag_that_would_not_act_is_refused_in_one_line(capsys, argv, names):
    assert names in refusal(capsys, *argv)


def test_every_recipe_field_the_plan_reads_is_a_planner_flag_with_the_recipe_s_help_and_choices():
    """python -m shardtune.plan takes the recipes' flags: each field the planned run reads (shardtune.plan.planned_run)
    is one, with the Recipe field's help and choices, so that the two command lines cannot drift apart."""
    tree = ast.parse(open(planned_run.__file__).read())
    read = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "recipe"}
    fields = {item.name: item for item in dataclasses.fields(Recipe)}
    assert read and read <= set(fields)
    assert sorted(read - set(RUN_FLAGS)) == []
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    actions = {action.dest: action for action in parser._actions}
    for name in RUN_FLAGS:
        assert actions[name].help.startswith(fields[name].metadata["help"]), name
        assert tuple(actions[name].choices or ()) == tuple(FIELD_CHOICES.get(name, ())), name


def test_the_save_flags_act_in_the_host_ram_plan(capsys):
    """--async_save true stages each rank's checkpoint shard in host RAM; --save_only_model false over it keeps the
    optimizer's states in that shard."""
    base = ("--model", str(REPO / "recipes" / "llama8b.py"), "--config_file",
            os.path.join(CONFIGS_DIR, "fsdp_full_shard.yaml"))
    staged = [run_json(capsys, *base, *flags)[1]["host_ram"]["checkpoint_staging"]
              for flags in ((), ("--async_save", "true", "--save_only_model", "true"), ("--async_save", "true"))]
    assert staged[0] == 0 < staged[1] < staged[2]


def test_a_flag_over_a_recipe_s_value_acts(capsys):
    """--packing false over a recipe's true, with SDPA and a micro-batch of 2: two padded rows with their masks,
    as plan() plans them."""
    shape = resolve_model("llama-3.1-8b")
    _, planned = run_json(capsys, "--model", LORA_RECIPE, "--config_file", DDP, "--packing", "false",
                          "--attn_implementation", "sdpa", "--per_device_train_batch_size", "2")
    expected = plan(shape, H100, read_accelerate_config(DDP, "bf16"), 2, 4096, False, "sdpa", Peft(16),
                    chunked_cross_entropy=True)
    assert planned["per_gpu"] == pytest.approx(expected.per_gpu)


def test_the_padding_multiple_acts_in_the_plan(capsys):
    """--max_seq_length 4000 padded to a multiple of 128 is planned as 4096 tokens; fp8 pads to 16 by itself."""
    _, padded = run_json(capsys, "--model", LORA_RECIPE, "--config_file", DDP, "--max_seq_length", "4000",
                         "--pad_to_multiple_of", "128")
    _, full = run_json(capsys, "--model", LORA_RECIPE, "--config_file", DDP, "--max_seq_length", "4096")
    _, plain = run_json(capsys, "--model", LORA_RECIPE, "--config_file", DDP, "--max_seq_length", "4000")
    assert padded["max_seq_length"] == 4096 and padded["per_gpu"] == full["per_gpu"] != plain["per_gpu"]
    _, fp8 = run_json(capsys, "--model", "llama-3.1-8b", "--config_file", DDP, "--max_seq_length", "4001",
                      "--mixed_precision", "fp8")
    assert fp8["max_seq_length"] == 4016


def test_chunked_cross_entropy_flag_acts_in_the_plan(capsys):
    """The recipe's default (the loss in tiles) and --chunked_cross_entropy false (the full logits): the
    activations differ by at most the full logits' term less one tile's (the peak moment is the larger of the
    loss's and a layer's backward, shardtune.plan.backward_moments, so not all of it when a layer's backward
    binds the tiled run), and --json says which was planned."""
    shape = resolve_model("llama-3.1-8b")
    _, tiled = run_json(capsys, "--model", LORA_RECIPE, "--config_file", DDP)
    _, full = run_json(capsys, "--model", LORA_RECIPE, "--config_file", DDP, "--chunked_cross_entropy", "false")
    assert tiled["chunked_cross_entropy"] is True and full["chunked_cross_entropy"] is False
    positions = 4096  # the recipe's one packed row
    full_logits = 12 * positions * shape.vocab  # saved fp32 log-probabilities + their two fp32 gradients
    one_tile = 12 * LOSS_TILE_POSITIONS * shape.vocab
    saved = full["per_gpu"]["activations"] - tiled["per_gpu"]["activations"]
    assert 0.95 * (full_logits - one_tile) < saved <= full_logits - one_tile


def test_the_planner_refuses_a_length_past_the_model_s_context_by_the_recipe_s_rule(capsys):
    _, config = resolve_config("llama-3.1-8b")
    with pytest.raises(ConfigError) as refused:
        check_context_length(Recipe(max_seq_length=200000), config)
    for argv in (["--model", "llama-3.1-8b", "--max_seq_length", "200000"],
                 ["--model", "llama-3.1-8b", "--max_seq_length", "200000", "--config_file", DDP],
                 ["--model", "llama-3.1-8b", "--max_seq_length", "200000", "--compare"],
                 ["--model", LORA_RECIPE, "--max_seq_length", "200000"]):
        assert refusal(capsys, *argv) == f"shardtune.plan: error: {refused.value.messages[0]}"
    assert "max_position_embeddings 131072" in refused.value.messages[0]
    assert main(["--model", "llama-3.1-8b", "--max_seq_length", "131072", "--config_file", DDP]) in (0, 1)
    capsys.readouterr()
    # A padded row's positions run to its padded length: 131,070 padded to a multiple of 48 is 131,088.
    with pytest.raises(ConfigError, match=r"padded to a multiple of 48 \(131088\) is above the model's "
                                          r"max_position_embeddings 131072: give --max_seq_length 131040 or less"):
        check_context_length(Recipe(max_seq_length=131070, pad_to_multiple_of=48), config)
    check_context_length(Recipe(max_seq_length=131072, pad_to_multiple_of=16), config)


def test_a_bare_model_under_an_fp8_config_is_planned_at_fp8_s_padded_length(tmp_path, capsys):
    """The accelerate config's precision is a bare model's: fp8 there pads rows to a multiple of 16."""
    fp8_config = tmp_path / "fsdp_fp8.yaml"
    fp8_config.write_text(open(os.path.join(CONFIGS_DIR, "fsdp_full_shard.yaml")).read().replace(
        "mixed_precision: bf16", "mixed_precision: fp8"))
    _, planned = run_json(capsys, "--model", "llama-3.1-8b", "--config_file", str(fp8_config), "--max_seq_length",
                          "4001")
    assert planned["max_seq_length"] == 4016


def test_a_recipe_is_planned_with_its_own_fields(capsys):
    """llama8b_lora.py: flex attention on packed rows (no dense mask), LoRA r=16, checkpointing off, bf16."""
    shape = resolve_model("llama-3.1-8b")
    _, planned = run_json(capsys, "--model", LORA_RECIPE, "--config_file", DDP)
    flex, dense = (plan(shape, H100, read_accelerate_config(DDP, "bf16"), 1, 4096, False, attn, Peft(16),
                        packing=True, chunked_cross_entropy=True) for attn in ("flash", "sdpa"))
    assert planned["per_gpu"] == pytest.approx(flex.per_gpu)
    assert planned["per_gpu"]["activations"] < dense.per_gpu["activations"]
    _, found = run_json(capsys, "--model", LORA_RECIPE)
    # The recommendation plans the recipe's levers too: the loss in tiles, not the full logits.
    assert found["chunked_cross_entropy"] and found["per_gpu"]["activations"] == pytest.approx(
        flex.per_gpu["activations"])


def test_a_recipe_s_unstated_fields_are_the_recipe_s_defaults(tmp_path, capsys):
    """A recipe that states no length runs at Recipe's default, not the planner's 4096; its precision and eval
    batch are its own."""
    recipe = tmp_path / "short.py"
    recipe.write_text('from shardtune import Recipe\n\nRECIPE = Recipe(model_name_or_path="meta-llama/Llama-3.1-8B", '
                      'mixed_precision="no", per_device_eval_batch_size=2)\n')
    _, planned = run_json(capsys, "--model", str(recipe), "--config_file", DDP)
    defaults = Recipe()
    assert planned["max_seq_length"] == defaults.max_seq_length != 4096
    assert planned["mixed_precision"] == "no"
    assert planned["gradient_checkpointing"] is defaults.gradient_checkpointing
    expected = plan(resolve_model("llama-3.1-8b"), H100, read_accelerate_config(DDP, "no"), 1, defaults.max_seq_length,
                    defaults.gradient_checkpointing, eval_batch=2)
    assert planned["phases"]["eval"]["total"] == pytest.approx(expected.phases["eval"]["total"])


def test_compare_table_and_chart_show_the_peak_phase_s_parts(tmp_path):
    """ddp's peak for 8B is the optimizer step: its bar, its table columns and its total are the same quantity."""
    shape = resolve_model("llama-3.1-8b")
    strategies = [read_accelerate_config(path, "bf16") for path in config_paths()]
    # fsdp_tp's 8-wide split needs a second node for FSDP2's dp_shard axis (the planner refuses it on one)
    plans = [plan(shape, H100, strategy, 1, 4096, True) for strategy in strategies if strategy.tensor_parallel == 1]
    assert {p.peak_phase for p in plans} > {"forward_backward"}  # the test covers another peak phase
    heights = write_chart(plans, str(tmp_path / "plan.png"))
    table = format_compare(plans).splitlines()
    assert table[0].split()[1:len(PEAK_COMPONENTS) + 2] == [*PEAK_COMPONENTS, "total"]
    for p in plans:
        assert heights[p.config] == pytest.approx(p.per_gpu["total"] / 1e9)
        assert sum(peak_components(p).values()) == pytest.approx(p.per_gpu["total"])
        row = next(line.split() for line in table if line.split()[0] == p.config)
        cells = [float(cell.rstrip("G")) for cell in row[1:len(PEAK_COMPONENTS) + 2]]
        assert cells[-1] == pytest.approx(p.per_gpu["total"] / 1e9, abs=0.05)
        assert sum(cells[:-1]) == pytest.approx(cells[-1], abs=0.05 * len(PEAK_COMPONENTS))
        assert row[len(PEAK_COMPONENTS) + 2] == p.peak_phase.replace("_", "/")

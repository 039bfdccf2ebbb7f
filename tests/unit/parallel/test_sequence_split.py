"""The sequence split (DeepSpeed Ulysses) without launching it: what a launch and a dry run refuse, the gradient scale
per ZeRO stage, the rows the collator hands it, and the plans the planner makes of it. Its training runs are in
tests/launch/test_sequence_split.py and, as shipped configs, in tests/launch/test_strategies.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig

from shardtune.cli import main
from shardtune.config import ConfigError, Recipe
from shardtune.data.batches import make_collator
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.launch import LaunchDescription
from shardtune.models.flops import resolve_model
from shardtune.parallel.sequence import (
    check_right_padding,
    check_sequence_split,
    check_split_heads,
    padded_to,
    sequence_split,
)
from shardtune.plan.__main__ import main as plan_main
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.planner import plan
from shardtune.plan.search import Search, recommend
from shardtune.plan.strategy import read_accelerate_config
from tests.conftest import REPO
from tests.unit.checks.test_checks_shared import PLANNED, dry_run_errors, no_launch  # noqa: F401 (autouse fixture)
from tests.unit.test_step import features

ULYSSES = str(REPO / "accelerate_configs" / "ds_zero3_ulysses.yaml")
ZERO3_JSON = str(REPO / "accelerate_configs" / "deepspeed" / "zero3.json")


# --- refusals ------------------------------------------------------------------------------------------------

DRY_RUN_REFUSALS = {
    "eager attention": (("--attn_implementation", "eager"), "--attn_implementation eager cannot run under the "
                                                            "sequence split (sp_size 8)"),
    "flex attention": (("--attn_implementation", "flex_attention"), "--attn_implementation flex_attention cannot "
                                                                     "run under the sequence split"),
    "packing under SDPA": (("--packing", "true", "--per_device_train_batch_size", "2"),
                           "the sequences of a packed row would attend to each other"),
    "a length the split does not divide": (("--max_seq_length", "1020"), "--max_seq_length 1020 is not a multiple "
                                                                         "of sp_size 8"),
}


@pytest.mark.parametrize("case", DRY_RUN_REFUSALS)
def test_the_dry_run_refuses_what_the_split_cannot_run(case, capsys):
    """Planned on one 8-GPU node (sp_size 8, the YAML's): each refusal is one line, before anything loads, in the
    dry run as in the launch (both run checks.check_on_device under the launch they read)."""
    args, refusal = DRY_RUN_REFUSALS[case]
    errors = dry_run_errors(capsys, ULYSSES, *args)
    assert any(refusal in line for line in errors), errors


def test_the_dry_run_plans_the_split(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(PLANNED, ["--dry_run", "--hardware", "8xh100-80gb", "--config_file", ULYSSES])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "states sharded over 8 GPUs, each sequence split over 8 GPUs" in out, out


def deepspeed_launch(monkeypatch, world: int, **parallelism: str) -> None:
    env = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO3_JSON,
           "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
    env.update({f"PARALLELISM_CONFIG_{name.upper()}": value for name, value in parallelism.items()})
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_a_split_launch_is_described_and_planned_as_launched(monkeypatch):
    deepspeed_launch(monkeypatch, 8, sp_size="4")
    launch = LaunchDescription.from_env()
    assert launch.sp_size == 4
    assert launch.description == "DeepSpeed ZeRO-3, sequences split over 4 ranks (Ulysses)"
    assert launch.strategy("bf16").sequence_split == 4


LAUNCH_REFUSALS = {
    "a split that does not divide the ranks": (8, {"sp_size": "3"}, "parallelism_config_sp_size 3 does not divide "
                                                                    "the 8 processes"),
    "data-parallel sizes beside the split": (8, {"sp_size": "2", "dp_shard_size": "4"},
                                             "sets dp_shard_size 4 beside sp_size 2"),
    "context parallelism": (8, {"cp_size": "2"}, "torch's context parallelism runs under FSDP2 only"),
}


@pytest.mark.parametrize("case", LAUNCH_REFUSALS)
def test_a_split_the_trainer_cannot_run_is_refused_in_one_line(case, monkeypatch):
    world, sizes, message = LAUNCH_REFUSALS[case]
    deepspeed_launch(monkeypatch, world, **sizes)
    with pytest.raises(ConfigError) as error:
        LaunchDescription.from_env()
    (line,) = error.value.messages
    assert message in line and "\n" not in line


def test_the_split_outside_deepspeed_is_refused(monkeypatch):
    deepspeed_launch(monkeypatch, 8, sp_size="2")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ConfigError) as error:
        LaunchDescription.from_env()
    assert "the sequence split runs through DeepSpeed's Ulysses" in error.value.messages[0]


@pytest.mark.parametrize(("heads", "kv_heads", "refused"), [
    (12, 4, "The model has 12 attention heads, which sp_size 8 does not divide"),
    (48, 6, "The model has 6 key/value heads, and sp_size 8 neither divides them"),
    (32, 2, None),  # each key/value head replicated 4 times
    (32, 16, None),
])
def test_the_split_must_divide_the_heads(heads, kv_heads, refused):
    config = LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=heads * 8)
    if refused is None:
        check_split_heads(config, 8)
        return
    with pytest.raises(ConfigError, match=refused):
        check_split_heads(config, 8)


def test_zero3_without_reduce_scatter_is_refused_under_the_split():
    """Its contiguous path divides a bucket under reduce_bucket_size by world / sp, a larger one by world
    (stage3.py): no one loss scale is right for both."""
    recipe = Recipe(name="x", max_seq_length=64)
    with pytest.raises(ConfigError, match="ZeRO-3 with reduce_scatter false under the sequence split"):
        check_sequence_split(recipe, 2, {"stage": 3, "reduce_scatter": False})
    check_sequence_split(recipe, 2, {"stage": 3, "reduce_scatter": True})
    check_sequence_split(recipe, 2, {"stage": 2, "reduce_scatter": False})
    check_sequence_split(recipe, 1, {"stage": 3, "reduce_scatter": False})  # no split, nothing to refuse


def test_the_gradient_scale_follows_what_each_stage_divides_by():
    """ZeRO-3's reduce-scatter averages over every rank, ZeRO-1/2 over world / sp: the step multiplies the loss by
    sp under ZeRO-3 only (tests/launch checks both against one process)."""
    assert sequence_split(1, {"stage": 3}) is None
    assert sequence_split(4, {"stage": 3}).reduction_factor == 4
    assert sequence_split(4, {"stage": 2}).reduction_factor == 1
    assert sequence_split(4, {"stage": 1}).reduction_factor == 1


def test_a_tokenizer_that_pads_left_is_refused(tiny_assets):
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    check_right_padding(tokenizer)
    tokenizer.padding_side = "left"
    with pytest.raises(ConfigError, match='set "padding_side": "right"'):
        check_right_padding(tokenizer)


# --- the rows it is handed -------------------------------------------------------------------------------------

def test_rows_for_the_split_carry_positions_and_no_mask(tiny_assets):
    """Ulysses needs each token's position before it cuts a row, and drops the mask: the collator gives position
    ids 0..n-1 per row, no mask, the padding on the right (after every real token) and a length the split
    divides."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    rows = features(tokenizer)
    batch = make_collator(tokenizer, multiple=4, unmasked=True)(rows)
    plain = make_collator(tokenizer, multiple=4)(rows)
    assert "attention_mask" not in batch and batch["input_ids"].shape[1] % 4 == 0
    length = batch["input_ids"].shape[1]
    assert torch.equal(batch["position_ids"], torch.arange(length).expand(len(rows), length))
    assert torch.equal(batch["input_ids"], plain["input_ids"]) and torch.equal(batch["labels"], plain["labels"])
    for row, mask in zip(rows, plain["attention_mask"], strict=True):  # right padding
        assert mask[:len(row["input_ids"])].all() and not mask[len(row["input_ids"]):].any()


def test_a_micro_batch_padded_to_its_groups_length_adds_nothing_to_learn():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[-100, 6, 7, 8]]),
             "position_ids": torch.tensor([[0, 1, 2, 3]])}
    padded = padded_to(batch, 8)
    assert padded["labels"][0, 4:].tolist() == [IGNORE_INDEX] * 4
    # positions go on: restarting ones would look packed to transformers, which would build a dense mask
    assert padded["position_ids"][0].tolist() == list(range(8))
    assert padded["input_ids"][0, :4].tolist() == [5, 6, 7, 8] and padded["input_ids"].shape == (1, 8)
    assert padded_to(batch, 4) is batch


# --- the planner -------------------------------------------------------------------------------------------------

def split_and_unsplit_plans(split_config: str, unsplit_config: str) -> tuple:
    """(split plan, unsplit plan) of Llama-3.1-8B at 131,072 tokens on one 8xH100-80GB node under a config that cuts
    every row over the 8 GPUs and the one it shards its states like, after checking what the split divides: the
    activations (1/8 of the positions, less the mask unsplit SDPA gets, which the split drops; Ulysses adds o_proj's
    exchanged input), not the states."""
    shape, hardware = resolve_model("llama-3.1-8b"), parse_hardware("8xh100-80gb")
    long, short = (plan(shape, hardware, read_accelerate_config(str(REPO / "accelerate_configs" / f"{config}.yaml"),
                                                                "bf16"),
                        1, 131072, checkpointing=True, chunked_cross_entropy=True)
                   for config in (split_config, unsplit_config))
    for key in ("weights", "gradients", "optimizer"):
        assert long.per_gpu[key] == short.per_gpu[key]
    ratio = short.per_gpu["activations"] / long.per_gpu["activations"]
    assert 8 <= ratio < 16, ratio
    return long, short


def test_the_split_divides_the_activations_not_the_states():
    assert read_accelerate_config(ULYSSES, "bf16").sequence_split == 8
    split_and_unsplit_plans("ds_zero3_ulysses", "ds_zero3")


def test_the_planner_answers_the_long_question_with_a_split(capsys):
    """python -m shardtune.plan --model llama-3.1-8b --hardware 8xh100-80gb --max_seq_length 131072: a config that
    fits, the split's; at 4,096 tokens the split is never the answer (it is tried once nothing unsplit fits)."""
    assert plan_main(["--model", "llama-3.1-8b", "--hardware", "8xh100-80gb", "--max_seq_length", "131072"]) == 0
    out = capsys.readouterr().out
    assert "ds_zero3_ulysses" in out and "-> fits" in out, out
    short = recommend(resolve_model("llama-3.1-8b"), parse_hardware("8xh100-80gb"), Search(64, 4096))
    assert short.plan is not None and "split" not in short.plan.layout


def test_a_split_the_model_or_node_cannot_take_is_not_planned():
    """Qwen2.5-7B's 28 heads do not divide by 8: not Ulysses, but context parallelism, which cuts positions, not
    heads; one GPU has nothing to split over."""
    qwen = recommend(resolve_model("qwen2.5-7b"), parse_hardware("8xh100-80gb"), Search(None, 131072))
    assert qwen.plan is not None and qwen.plan.config == "fsdp_cp", qwen.message
    found = recommend(resolve_model("llama-3.2-1b"), parse_hardware("1xh100-80gb"), Search(None, 131072))
    assert found.plan is None or "split" not in found.plan.layout, found.message

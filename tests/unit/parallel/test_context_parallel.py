"""Context parallelism without launching it: the launch described and planned as accelerate runs it, the launches
and recipes it cannot run refused in one line before anything loads, a micro-batch's labels shifted before the cut.
Its training runs are in tests/launch/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from shardtune.checks.startup import batch_sizes
from shardtune.config import ConfigError, Recipe
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.launch import LaunchDescription
from shardtune.models.flops import resolve_model
from shardtune.parallel.context import (
    check_context_model,
    check_context_parallel,
    one_sequence_per_row,
    ring_attention_runs_on_cpu,
    with_shifted_labels,
)
from shardtune.plan.context import ring_attention_bytes
from shardtune.plan.strategy import read_accelerate_config
from tests.conftest import CONFIGS
from tests.unit.checks.test_checks_shared import no_launch  # noqa: F401 (autouse fixture)
from tests.unit.parallel.test_sequence_split import split_and_unsplit_plans
from tests.unit.parallel.test_tensor_parallel import tp_launch

CP_CONFIG = str(CONFIGS / "fsdp_cp.yaml")


def test_a_context_parallel_launch_is_described_with_its_data_ranks(monkeypatch):
    tp_launch(monkeypatch, "fsdp", 16, cp_size="8", dp_shard_size="2")
    launch = LaunchDescription.from_env()
    assert (launch.cp_size, launch.data_parallel_size) == (8, 2)
    assert launch.description == "FSDP2 FULL_SHARD, sequences split over 8 ranks (context parallel)"
    assert launch.strategy("bf16").context_parallel == 8


LAUNCH_REFUSALS = {
    "under DeepSpeed": ("deepspeed", 8, {"cp_size": "2"}, "torch's context parallelism runs under FSDP2 only"),
    "under DDP": ("ddp", 2, {"cp_size": "2"}, "accelerate runs context parallelism under FSDP2 only"),
    "beside tensor parallelism": ("fsdp", 8, {"cp_size": "2", "tp_size": "2", "dp_shard_size": "2"},
                                  "context parallelism composes with neither here"),
    "sizes that miss the ranks": ("fsdp", 8, {"cp_size": "2", "dp_shard_size": "2"},
                                  "dp_replicate_size 1 x dp_shard_size 2 x cp_size 2 is not the 8 processes"),
}


@pytest.mark.parametrize("case", LAUNCH_REFUSALS)
def test_a_context_parallel_launch_the_trainer_cannot_run_is_refused_in_one_line(case, monkeypatch):
    kind, world, sizes, message = LAUNCH_REFUSALS[case]
    tp_launch(monkeypatch, kind, world, **sizes)
    with pytest.raises(ConfigError) as error:
        LaunchDescription.from_env()
    (line,) = error.value.messages
    assert message in line and "\n" not in line, line


def test_the_global_batch_counts_the_data_ranks():
    batching = batch_sizes(Recipe(per_device_train_batch_size=1, global_batch_size=8), 16, cp_size=8)
    assert (batching.data_parallel_size, batching.accumulation, batching.global_batch) == (2, 4, 8)
    with pytest.raises(ConfigError, match=r"per_device_train_batch_size x data ranks \(processes / cp_size 8\)"):
        batch_sizes(Recipe(per_device_train_batch_size=1, global_batch_size=3), 16, cp_size=8)


RECIPE_REFUSALS = {
    "on CPU": ({}, False, "torch's ring attention runs CUDA's flash, memory-efficient or cuDNN attention only"),
    "eager attention": ({"attn_implementation": "eager"}, True, "torch's ring attention replaces SDPA only"),
    "packing": ({"packing": True}, True, "a packed row's sequences would attend to each other"),
    "a length the chunks do not divide": ({"max_seq_length": 4100}, True, "not a multiple of 2 x cp_size = 8"),
    "fp32 on GPUs": ({"mixed_precision": "no"}, True, "fp32 attention over grouped key/value heads may fall to"),
    "levers no test runs under it": ({"use_liger_kernel": True, "method": "dpo"}, True,
                                     "--use_liger_kernel, --method dpo under context parallelism (cp_size 4): not run"),
}


@pytest.mark.parametrize("case", RECIPE_REFUSALS)
def test_a_recipe_the_ring_attention_cannot_run_is_refused_in_one_line(case):
    fields, on_gpu, message = RECIPE_REFUSALS[case]
    recipe = Recipe(**{"max_seq_length": 4096, "mixed_precision": "bf16", **fields})
    check_context_parallel(Recipe(max_seq_length=4096, mixed_precision="bf16"), 4, on_gpu=True)
    with pytest.raises(ConfigError) as error:
        check_context_parallel(recipe, 4, on_gpu=on_gpu)
    (line,) = error.value.messages
    assert message in line and "\n" not in line, line


def test_cpu_is_refused_by_what_torch_dispatches():
    """The refusal reads torch's own table: torch 2.13's ring attention handles no CPU attention op (the launch
    tests add one, tests/launch/context_parallel_probe.py, in their processes only)."""
    assert not ring_attention_runs_on_cpu()


def test_a_sliding_window_model_is_refused():
    check_context_model(LlamaConfig(), 8)
    with pytest.raises(ConfigError, match="sliding_attention layers, which torch's ring attention"):
        check_context_model(MistralConfig(sliding_window=4096), 8)
    check_context_model(MistralConfig(sliding_window=4096), 1)


def test_the_labels_are_shifted_before_the_cut_and_the_mask_dropped():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[IGNORE_INDEX, 6, 7, 8]]),
             "attention_mask": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None]}
    split = with_shifted_labels(batch)
    assert set(split) == {"input_ids", "position_ids", "shift_labels"}
    # each position's label is the next token: the last chunk's last position has none
    assert split["shift_labels"].tolist() == [[6, 7, 8, IGNORE_INDEX]]


def test_a_chunk_s_jumping_positions_make_no_dense_mask():
    """Rank 0 of 2 holds chunks 0 and 3 of a 4-chunk row (torch's head-tail load balancing): transformers would take
    the jump for packed sequences and build a mask that accelerate's CP hooks drop; inside the split it makes none."""
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "sdpa"
    embeds, positions = torch.zeros(1, 4, 8), torch.tensor([[0, 1, 6, 7]])
    assert create_causal_mask(config, embeds, None, None, position_ids=positions) is not None
    with one_sequence_per_row():
        assert create_causal_mask(config, embeds, None, None, position_ids=positions) is None
    assert create_causal_mask(config, embeds, None, None, position_ids=positions) is not None


# --- the planner -------------------------------------------------------------------------------------------------

def test_the_config_cuts_every_sequence_over_a_node():
    strategy = read_accelerate_config(CP_CONFIG, "bf16")
    assert (strategy.kind, strategy.context_parallel, strategy.tensor_parallel) == ("fsdp", 8, 1)
    assert "each sequence split over 8 GPUs (context parallel)" in strategy.layout(8)


def test_context_parallelism_divides_the_activations_not_the_states():
    long, short = split_and_unsplit_plans("fsdp_cp", "fsdp_full_shard")
    # the ring attention's buffers for one layer: at least the whole row's keys and values, gathered in bf16
    shape = resolve_model("llama-3.1-8b")
    ring = ring_attention_bytes(shape, 1, 131072 // 8, "half", 8)
    assert ring > 2 * 131072 * shape.kv_heads * shape.head_dim * 2
    assert long.per_gpu["buffers"] - ring == pytest.approx(short.per_gpu["buffers"], rel=0.01)
    assert long.fits and not short.fits

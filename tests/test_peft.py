"""LoRA on DDP, FSDP and ZeRO-3 with 2 real processes: the same losses and the same saved adapter on every
strategy (ZeRO-3's run also packs its micro-batches, so packed training is checked against padded training),
the frozen base untouched, a peft-format adapter that round-trips, and a merge that changes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardtune.flops import resolve_model
from shardtune.plan import Peft, peft_states, read_accelerate_config
from tests.conftest import CONFIGS, ENV, REFERENCE_ARGS, REPO, read_metrics, run_recipe, train_losses

LORA_ARGS = (*REFERENCE_ARGS, "--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0",
             "--gradient_checkpointing", "true", "--save_steps", "8")
STRATEGIES = {"ddp": (), "fsdp_full_shard": (), "ds_zero3": ("--packing", "true")}


@pytest.fixture(scope="module")
def lora_runs(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    for config, extra in STRATEGIES.items():
        run_recipe(root / config, tiny_assets, *LORA_ARGS, *extra, config=config, processes=2)
    return {config: root / config for config in STRATEGIES}


def test_lora_trains_the_same_on_every_strategy(lora_runs):
    reference = train_losses(lora_runs["ddp"])
    assert reference[-1] < reference[0] - 0.1, f"LoRA loss did not fall: {reference}"
    adapter = load_file(lora_runs["ddp"] / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)
    assert any(value.abs().sum() > 0 for key, value in adapter.items() if "lora_B" in key)  # B starts at zero
    for config, output_dir in lora_runs.items():
        assert train_losses(output_dir) == pytest.approx(reference, rel=1e-5), config
        saved = load_file(output_dir / "adapter_model.safetensors")
        assert saved.keys() == adapter.keys(), config
        for key, tensor in adapter.items():
            assert saved[key].shape == tensor.shape and saved[key].numel() > 0, f"{config}: {key} is empty"
            torch.testing.assert_close(saved[key], tensor, rtol=1e-4, atol=1e-5, msg=f"{config}: {key}")


def test_token_utilization_is_logged_packed_and_padded(lora_runs):
    def utilization(config: str) -> list[float]:
        return [row["token_utilization"] for row in read_metrics(lora_runs[config]) if "loss" in row]

    assert all(value == 1.0 for value in utilization("ds_zero3"))  # packed: no padding at all
    assert all(0.5 < value < 0.95 for value in utilization("ddp"))


def test_frozen_base_is_unchanged(lora_runs, tiny_assets):
    """The DDP checkpoint holds the whole PEFT model: every base tensor equals the one loaded at the start."""
    initial = load_file(f"{tiny_assets[0]}/model.safetensors")
    state = load_file(lora_runs["ddp"] / "checkpoint-8" / "model.safetensors")
    base = {key.removeprefix("base_model.model.").replace(".base_layer", ""): value
            for key, value in state.items() if "lora_" not in key}
    assert base.keys() == initial.keys()
    for key, tensor in initial.items():
        assert torch.equal(base[key], tensor), key


def test_adapter_round_trip_and_merge(lora_runs, tiny_assets, tmp_path):
    adapter_dir = lora_runs["ds_zero3"]
    merged_dir = tmp_path / "merged"
    subprocess.run([sys.executable, str(REPO / "scripts" / "merge_lora.py"), str(adapter_dir), str(merged_dir)],
                   check=True, env=ENV, capture_output=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32)
    input_ids = torch.randint(4, base.config.vocab_size, (2, 16))
    with torch.no_grad():
        base_logits = base(input_ids).logits
        adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
        adapted_logits = adapted(input_ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(input_ids).logits
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-3), "the adapter changes nothing"
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=1e-4, atol=1e-5)


def test_planned_lora_states_equal_the_bytes_each_rank_holds(lora_runs, tiny_assets):
    """The planner's PEFT model states (frozen base: weights only; adapters: weights, gradients, Adam) against
    what the ranks of each LoRA run really held at their first step."""
    shape = resolve_model(tiny_assets[0])
    peft = Peft(rank=4)
    for config, output_dir in lora_runs.items():
        (row,) = [row for row in read_metrics(output_dir) if "held_weights_bytes" in row]
        strategy = read_accelerate_config(str(CONFIGS / f"{config}.yaml"), mixed_precision="no")
        planned = peft_states(strategy, shape, 2, peft)
        assert row["held_weights_bytes"] == pytest.approx(planned.weights, rel=1e-2), config
        assert row["held_optimizer_bytes"] == pytest.approx(planned.optimizer, rel=1e-2), config
        assert row["held_gradients_bytes"] == pytest.approx(planned.gradients, rel=0.05), config

"""LoRA on DDP, FSDP and ZeRO-3 with 2 real processes: the same losses, gradient norms and saved adapter on every
strategy (FSDP's and ZeRO-3's runs also pack their micro-batches, so packed training is checked against padded
training; conftest.lora_run),
the frozen base untouched (fp32, and the documented bf16 base on every strategy), a peft-format adapter that
round-trips, and a merge that changes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from shardtune.models.flops import resolve_model
from shardtune.plan.states import Peft, peft_states
from tests.conftest import (
    ENV,
    LORA_ARGS,
    LORA_STRATEGIES,
    REPO,
    grad_norms,
    load_script,
    read_metrics,
    run_recipe,
    strategy_as_launched,
    train_losses,
)

STRATEGIES = tuple(LORA_STRATEGIES)
# The saved adapters of the three strategies agree to this (the figure of docs/training.md): the ranks change only
# the order of float sums (observed: 5e-8 after eight AdamW steps, the runs now take four).
ADAPTER_MAX_DIFFERENCE = 1e-6
# The documented layout, checked on every strategy: the frozen base in bf16, the adapters in fp32.
BF16_LORA_ARGS = (*LORA_ARGS, "--mixed_precision", "bf16")


@pytest.fixture(scope="module")
def lora_runs(lora_run):
    return {config: lora_run(config) for config in STRATEGIES}


def test_lora_trains_the_same_on_every_strategy(lora_runs):
    reference = train_losses(lora_runs["ddp"])
    assert reference[-1] < reference[0] - 0.1, f"LoRA loss did not fall: {reference}"
    adapter = load_file(lora_runs["ddp"] / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)
    assert any(value.abs().sum() > 0 for key, value in adapter.items() if "lora_B" in key)  # B starts at zero
    differences = {}
    for config, output_dir in lora_runs.items():
        assert train_losses(output_dir) == pytest.approx(reference, rel=1e-5), config
        assert grad_norms(output_dir) == pytest.approx(grad_norms(lora_runs["ddp"]), rel=1e-5), config
        saved = load_file(output_dir / "adapter_model.safetensors")
        assert saved.keys() == adapter.keys(), config
        for key, tensor in adapter.items():
            assert saved[key].shape == tensor.shape and saved[key].numel() > 0, f"{config}: {key} is empty"
            assert saved[key].dtype == torch.float32, f"{config}: {key} is {saved[key].dtype}"
        differences[config] = max(float((saved[key] - tensor).abs().max()) for key, tensor in adapter.items())
    print(f"LoRA adapters: max difference from DDP's {differences}")
    assert max(differences.values()) <= ADAPTER_MAX_DIFFERENCE, differences


def test_token_utilization_is_logged_packed_and_padded(lora_runs):
    def utilization(config: str) -> list[float]:
        return [row["token_utilization"] for row in read_metrics(lora_runs[config]) if "loss" in row]

    assert all(value == 1.0 for config in ("fsdp_full_shard", "ds_zero3") for value in utilization(config))  # packed
    assert all(0.5 < value < 0.95 for value in utilization("ddp"))


def base_in_checkpoint(checkpoint: Path, config: str, scratch: Path) -> dict[str, torch.Tensor]:
    """The frozen base tensors of a LoRA checkpoint as the strategy saved them: DDP's whole PEFT model, FSDP's
    torch.distributed.checkpoint shards, ZeRO-3's frozen partitions, each read back whole."""
    if config == "ddp":
        state = load_file(checkpoint / "model.safetensors")
    elif config.startswith("fsdp"):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        (shards,) = [path for path in checkpoint.iterdir() if path.is_dir() and path.name.startswith("pytorch_model")]
        dcp_to_torch_save(shards, scratch / "fsdp.pt")
        state = torch.load(scratch / "fsdp.pt", weights_only=True)
        state = state.get("model", state)
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")
    return {key.removeprefix("model.").removeprefix("base_model.model.").replace(".base_layer", ""): value
            for key, value in state.items() if "lora_" not in key}


def check_base_unchanged(base: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], dtype, name: str) -> None:
    assert base.keys() == initial.keys(), f"{name}: {sorted(base.keys() ^ initial.keys())[:6]}"
    for key, tensor in initial.items():
        assert base[key].dtype == dtype, f"{name}: {key} is {base[key].dtype}"
        assert torch.equal(base[key], tensor.to(dtype)), f"{name}: {key} changed"


def test_frozen_base_is_unchanged(lora_runs, tiny_assets, tmp_path):
    """fp32 base: every base tensor of the DDP checkpoint equals the one loaded at the start."""
    initial = load_file(f"{tiny_assets[0]}/model.safetensors")
    base = base_in_checkpoint(lora_runs["ddp"] / "checkpoint-4", "ddp", tmp_path)
    check_base_unchanged(base, initial, torch.float32, "ddp")


# The sharded layouts; under DDP every rank holds the base as loaded (test_frozen_base_is_unchanged, in fp32).
@pytest.mark.parametrize("config", [config for config in STRATEGIES if config != "ddp"])
def test_bf16_base_layout_and_base_unchanged(config, tiny_assets, tmp_path):
    """The documented bf16 layout on each strategy: the base is held and saved in bf16, bit for bit the loaded
    weights after training, and the adapters train and are saved in fp32."""
    output_dir = tmp_path / "out"
    run_recipe(output_dir, tiny_assets, *BF16_LORA_ARGS, config=config, processes=2)
    initial = load_file(f"{tiny_assets[0]}/model.safetensors")
    base = base_in_checkpoint(output_dir / "checkpoint-4", config, tmp_path)
    check_base_unchanged(base, initial, torch.bfloat16, config)
    adapter = load_file(output_dir / "adapter_model.safetensors")
    assert adapter and all(tensor.dtype == torch.float32 for tensor in adapter.values()), config
    assert any(tensor.abs().sum() > 0 for key, tensor in adapter.items() if "lora_B" in key), config  # trained


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


@pytest.mark.parametrize("config", STRATEGIES)
def test_lora_checkpoint_exports_as_the_merged_model(config, lora_runs, tiny_assets, tmp_path):
    """export_hf.py on a LoRA run's checkpoint (the peft model under peft's names, as each strategy saves it) writes
    the merged model: it loads whole as the base's class and gives the logits of the base with the run's own
    adapter export; with --adapter it writes that adapter. The checkpoint is the run's last step's."""
    output_dir = lora_runs[config]
    checkpoint = output_dir / "checkpoint-4"
    export_hf = load_script("export_hf")  # in this process: the libraries are imported already
    export_hf.main([str(checkpoint), str(tmp_path / "merged")])
    export_hf.main([str(checkpoint), str(tmp_path / "adapter"), "--adapter"])
    base = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32)
    input_ids = torch.randint(4, base.config.vocab_size, (2, 16))
    merged, info = LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        adapted_logits = PeftModel.from_pretrained(base, output_dir).eval()(input_ids).logits
        merged_logits = merged.eval()(input_ids).logits
        fresh = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32)
        exported_adapter_logits = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()(input_ids).logits
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(exported_adapter_logits, adapted_logits, rtol=0, atol=1e-5)


def test_planned_lora_states_equal_the_bytes_each_rank_holds(lora_runs, tiny_assets):
    """The planner's PEFT model states (frozen base: weights only; adapters: weights, gradients, Adam) against
    what the ranks of each LoRA run really held at their first step."""
    shape = resolve_model(tiny_assets[0])
    peft = Peft(rank=4)
    for config, output_dir in lora_runs.items():
        (row,) = [row for row in read_metrics(output_dir) if "held_weights_bytes" in row]
        strategy = strategy_as_launched(config)
        planned = peft_states(strategy, shape, 2, peft)
        assert row["held_weights_bytes"] == pytest.approx(planned.weights, rel=1e-2), config
        assert row["held_optimizer_bytes"] == pytest.approx(planned.optimizer, rel=1e-2), config
        assert row["held_gradients_bytes"] == pytest.approx(planned.gradients, rel=0.05), config


@pytest.mark.parametrize("config", ["fsdp_full_shard", "ds_zero3"])
def test_adapter_export_gathers_the_adapter_only(config, tiny_assets, tmp_path):
    """The export of a LoRA run on sharded strategies all-gathers the adapter tensors and nothing of the frozen base
    (for a 70B base, 141 GB against an adapter under 1 GB), and writes the adapter accelerate's whole gathered state
    dict holds (tests/launch/adapter_gather_probe.py, the recipe's model as the trainer prepares it)."""
    import json

    result = run_recipe(tmp_path / "out", tiny_assets, *LORA_ARGS, config=config, processes=2,
                        recipe=REPO / "tests" / "launch" / "adapter_gather_probe.py")
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("probe: ")]
    probe = json.loads(line.removeprefix("probe: "))
    print(config, probe)
    assert probe["same_adapter"]
    assert 0 < probe["adapter_bytes"] < probe["model_bytes"] / 10
    assert probe["export_gathered_bytes"] == probe["adapter_bytes"]  # each adapter tensor gathered once
    assert probe["state_dict_gathered_bytes"] >= probe["model_bytes"]  # what the export gathered before

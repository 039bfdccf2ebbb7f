"""gpu_check's comparison of a Liger or fp8 case with its plain case can fail: on a random-initialised decoder whose
loss sits near ln(vocabulary) whatever it computes, a decoder whose linears are scaled by 50, or replaced by noise,
moves the loss by well under 2% (the old loss-only check passed both) but the first step's gradient norm and the
final hidden states of a fixed batch by far more than either tolerance; the same model passes. Scaled down from the
GPU check's model to run on CPU: hidden 512, vocabulary 32k, 4 layers."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardtune.gpu_check.figures import COMPARED, comparison, last_hidden_states, over_tolerance, relative_gaps

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_and_batch():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=32_000, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, ids, figures(model, ids)


def figures(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """What a case yields to the comparison: step 1's gradient norm (the fixed batch's loss, before clipping), the
    final hidden states of the fixed batch, the loss."""
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return {"grad_norm": float(grad_norm), "hidden": last_hidden_states(model, ids), "losses": [loss.item()]}


def decoder_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [module for name, module in model.model.layers.named_modules() if name.split(".")[-1] in LINEARS]


def scaled(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    broken = copy.deepcopy(model)
    with torch.no_grad():
        for linear in decoder_linears(broken):
            linear.weight.mul_(factor)
    return broken


def noise(model: torch.nn.Module) -> torch.nn.Module:
    broken = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for linear in decoder_linears(broken):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * linear.weight.std())
    return broken


def test_the_same_model_passes(model_and_batch):
    model, ids, plain = model_and_batch
    gaps = relative_gaps(figures(copy.deepcopy(model), ids), plain)
    assert set(gaps) == {"grad_norm", "hidden", "loss"} and max(gaps.values()) < 1e-5, gaps
    assert all(over_tolerance(gaps, tolerance) == [] for tolerance in COMPARED.values())


@pytest.mark.parametrize("broken", ["scaled by 50", "noise"])
def test_a_broken_decoder_fails_on_gradient_norm_and_hidden_states(model_and_batch, broken):
    """(Measured: scaled by 50, gradient norm +6,500%, hidden states 140%, loss 1.7%; noise: 9%, 139%, 1.1%.)"""
    model, ids, plain = model_and_batch
    gaps = relative_gaps(figures(scaled(model, 50.0) if broken == "scaled by 50" else noise(model), ids), plain)
    assert gaps["loss"] < 0.02, gaps  # the loss alone cannot tell
    for tolerance in COMPARED.values():  # the levers are compared on the gradient norms and losses only
        assert {"grad_norm", "hidden"} & set(tolerance) <= set(over_tolerance(gaps, tolerance)), gaps
        assert "grad_norm" in over_tolerance(gaps, tolerance)


def test_a_comparison_that_did_not_happen_fails(tmp_path, model_and_batch):
    """From the rows gpu_check writes: the hidden states read back from their files; a row without them (the probe
    failed or the budget ran out) or without a gradient norm fails the comparison instead of passing it."""
    model, ids, _ = model_and_batch
    torch.save(last_hidden_states(model, ids), tmp_path / "plain.pt")
    torch.save(last_hidden_states(noise(model), ids), tmp_path / "fp8.pt")
    plain = {"case": "fsdp_full_shard padded x4", "first_grad_norm": 2.0, "losses": [10.0, 9.9],
             "hidden_file": str(tmp_path / "plain.pt")}
    fp8 = {**plain, "case": "fsdp_full_shard padded x4 fp8", "first_grad_norm": 2.01, "losses": [10.05, 9.9],
           "hidden_file": str(tmp_path / "fp8.pt")}
    result = comparison(fp8, plain)
    assert result["gaps"]["grad_norm"] == pytest.approx(0.005) and result["gaps"]["loss"] == pytest.approx(0.005)
    assert result["failed"] == ["hidden"] and result["gaps"]["hidden"] > 1
    assert comparison({**fp8, "hidden_file": str(tmp_path / "plain.pt")}, plain)["failed"] == []
    unprobed = comparison({**fp8, "hidden_file": None, "first_grad_norm": None}, plain)
    assert unprobed["failed"] == ["grad_norm", "hidden"] and math.isnan(unprobed["gaps"].get("hidden", math.nan))

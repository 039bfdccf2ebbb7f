"""gpu_check's comparisons fail when a feature does nothing, on CPU: the modules Liger and fp8 replaced are counted
in the model the trainer's own conversion ran on (scripts/device_counted_launch.py wraps it) and must be the planned
number, so either conversion patched to do nothing fails its case; every logged gradient norm is compared, not only
step 1's; the levers case is compared with its plain twin; a NaN fails every check."""

from __future__ import annotations

import json
import math

import pytest
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from shardtune.gpu_check.figures import (
    comparison,
    failed_cases,
    new_comparisons,
    planned_replacements,
    replaced_modules,
    replacement_misses,
    reserve_misses,
    worst_error,
)
from tests.conftest import load_script

LAYERS = 3


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256)
    return LlamaForCausalLM(config)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The trainer's conversions wrapped as the device launch wraps them (restored after the test, Liger's RoPE too:
    it patches the modeling module, not the model); the path the counts are written to."""
    import shardtune.trainer as trainer

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    monkeypatch.setattr(trainer, "apply_liger_kernels", trainer.apply_liger_kernels)
    monkeypatch.setattr(trainer, "convert_linears", trainer.convert_linears)
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "replaced.json"
    return trainer, path, modeling_llama.apply_rotary_pos_emb


def trained_row(name: str, suffix: str, replaced: dict | None) -> dict:
    """A trained case's row as gpu_check writes it, its peaks and reserves within the plan."""
    return {"case": name, "losses": [5.5, 5.4], "grad_norms": [2.0, 1.9], "first_grad_norm": 2.0,
            "train_error": 0.01, "save_error": 0.0, "eval_error": -0.02, "fragmentation_gb": 1.0,
            "fragmentation_planned_gb": 8.0, "outside_allocator_gb": 1.0, "outside_allocator_planned_gb": 2.1,
            "replaced": replaced, "replaced_planned": planned_replacements(suffix, LAYERS)}


@pytest.mark.parametrize("feature", ["liger", "fp8"])
def test_a_conversion_patched_to_do_nothing_fails_its_case(feature, counted, monkeypatch):
    trainer, path, plain_rope = counted
    launch = load_script("device_counted_launch")
    suffix = f" {feature}"
    name = f"fsdp_full_shard padded x4{suffix}"

    def convert(model):
        if feature == "liger":
            trainer.apply_liger_kernels(model)
        else:
            trainer.convert_linears(model, all_gather=False, emulate=True)

    launch.install_counters(str(path))
    convert(tiny_llama())
    recorded = json.loads(path.read_text())
    assert {key: recorded[key] for key in planned_replacements(suffix, LAYERS)} == planned_replacements(suffix, LAYERS)
    compared = [{"comparison": name, "failed": []}]  # its figures within tolerance of its plain twin's
    assert replacement_misses(trained_row(name, suffix, recorded)) == []
    assert failed_cases([trained_row(name, suffix, recorded)], compared) == []
    # the same conversion made a no-op where the trainer calls it: the count says so and the case fails
    monkeypatch.setattr(trainer, "apply_liger_kernels", lambda model: None)
    monkeypatch.setattr(trainer, "convert_linears", lambda model, *args, **kwargs: [])
    modeling_llama.apply_rotary_pos_emb = plain_rope  # (the fixture restores it after the test either way)
    path.unlink()
    launch.install_counters(str(path))
    convert(tiny_llama())
    idle = json.loads(path.read_text())
    planned = planned_replacements(suffix, LAYERS)
    assert [key for key in planned if idle[key] != planned[key]]
    row = trained_row(name, suffix, idle)
    assert replacement_misses(row) and failed_cases([row], compared) == [name]
    assert failed_cases([trained_row(name, suffix, None)], compared) == [name]  # nothing recorded fails too
    assert failed_cases([{**trained_row(name, suffix, recorded), "replaced_planned": None}], compared) == [name]


def test_a_plain_model_counts_nothing():
    assert replaced_modules(tiny_llama())["float8_linears"] == 0
    assert replaced_modules(tiny_llama())["liger_swiglu"] == 0


def test_every_logged_gradient_norm_is_compared():
    plain = {"case": "ds_zero3 padded x1", "grad_norms": [2.0, 1.8, 1.7, 1.6], "losses": [5.5, 5.4, 5.3, 5.2]}
    later = {**plain, "case": "ds_zero3 padded x1 liger", "grad_norms": [2.0, 1.8, 1.7, 1.9]}  # step 4 off by 19%
    found = comparison(later, plain)
    assert found["gaps"]["grad_norm"] == pytest.approx(0.3 / 1.6)
    assert "grad_norm" in found["failed"]
    shorter = {**later, "grad_norms": [2.0, 1.8]}  # fewer steps logged: no comparison, a failure
    assert math.isnan(comparison(shorter, plain)["gaps"]["grad_norm"])
    assert "grad_norm" in comparison(shorter, plain)["failed"]


def test_the_levers_case_is_compared_with_its_plain_twin():
    plain = {"case": "fsdp_full_shard packed x4", "grad_norms": [2.0, 1.8], "losses": [5.5, 5.4]}
    levers = {**plain, "case": "fsdp_full_shard packed x4 levers", "grad_norms": [2.01, 1.81],
              "losses": [5.51, 5.41]}
    (found,) = new_comparisons({row["case"]: row for row in (plain, levers)}, set())
    assert found["plain"] == plain["case"] and found["failed"] == [] and set(found["gaps"]) == {"grad_norm", "loss"}
    broken = {**levers, "losses": [5.51, 5.9]}  # an optimizer that diverged at step 2
    (found,) = new_comparisons({row["case"]: row for row in (plain, broken)}, set())
    assert found["failed"] == ["loss"]
    trained = trained_row(levers["case"], " levers", None)
    assert failed_cases([trained], []) == [levers["case"]]  # its comparison missing: a failure
    assert failed_cases([trained], [{"comparison": levers["case"], "failed": []}]) == []


def test_a_nan_fails_every_check():
    nan = math.nan
    row = trained_row("ddp padded x1", "", None)
    assert failed_cases([row]) == []
    for key, value in (("train_error", nan), ("fragmentation_gb", nan), ("outside_allocator_planned_gb", nan),
                       ("losses", [5.5, nan]), ("grad_norms", [nan, 1.9]), ("grad_norms", [2.0, None])):
        assert failed_cases([{**row, key: value}]) == ["ddp padded x1"], key
    assert math.isnan(worst_error({**row, "save_error": nan}))
    assert reserve_misses({**row, "fragmentation_gb": nan}) == ["fragmentation"]
    plain = {"case": "ddp padded x1", "grad_norms": [2.0, 1.9], "losses": [5.5, 5.4]}
    for key, value in (("grad_norms", [2.0, nan]), ("losses", [nan, 5.4])):
        found = comparison({**plain, "case": "ddp padded x1 levers", key: value}, plain)
        assert found["failed"] == [{"grad_norms": "grad_norm", "losses": "loss"}[key]]

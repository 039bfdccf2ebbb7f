"""scripts/gpu_check.py's arithmetic, without a GPU: a case's figures from its metrics.jsonl rows (the warm-up steps
apart, the training peaks over the timed steps only, the planner's reserves against what was reserved), the
lengths a packed row is planned at, the cases' flags and plans, and the table, a FAILED row included."""

from __future__ import annotations

import inspect
import math

import pytest

from shardtune.config import Recipe
from shardtune.flags import parse_recipe
from shardtune.gpu_check.figures import WARMUP_STEPS
from shardtune.plan.planner import GPU_FIXED_RESERVE, GPU_HEADROOM_FRACTION, plan
from tests.conftest import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def metrics_rows() -> list[dict]:
    """Six steps, each logged (the first two compile and autotune: slow, with the largest peak), then the export's
    and the eval's peaks."""
    steps = [(1, 12.0, 500.0, 0.05, 30.0, 31.0, 33.0), (2, 6.0, 1000.0, 0.10, 25.0, 33.0, 35.0),
             (3, 1.0, 9000.0, 0.40, 20.0, 22.0, 24.0), (4, 1.0, 9000.0, 0.40, 21.0, 22.5, 24.5),
             (5, 1.2, 7000.0, 0.30, 21.5, 23.0, 25.0), (6, 1.2, 7000.0, 0.30, 21.0, 23.0, 25.0)]
    rows = [{"step": step, "loss": 3.0, "grad_norm": 2.0 + step, "step_time_s": seconds,
             "tokens_per_second_per_device": rate, "mfu": mfu, "peak_memory_gb": peak, "peak_reserved_gb": reserved,
             "device_used_gb": used} for step, seconds, rate, mfu, peak, reserved, used in steps]
    return rows + [{"step": 6, "save_peak_memory_gb": 12.0}, {"step": 6, "eval_loss": 3.1},
                   {"step": 6, "eval_peak_memory_gb": 10.0}]


def test_a_case_is_summarized_with_its_warmup_apart(gpu_check):
    assert WARMUP_STEPS == 2
    planned = {"train": 23.0, "save": 12.0, "eval": 12.0}  # metrics.jsonl, the table and the planner speak GB
    summary = gpu_check.summarize(metrics_rows(), planned, 80.0)
    assert summary["warmup_s"] == 18.0  # steps 1 and 2: 12 s + 6 s
    assert summary["first_grad_norm"] == 3.0  # step 1's, compared with the plain case's
    assert summary["tokens_per_second_per_gpu"] == 8000.0 and summary["mfu"] == pytest.approx(0.35)
    assert summary["step_time_s"] == 1.1  # median of the timed steps
    # the training peaks over the timed steps only: not the warm-up's 30 GB allocated, 33 GB reserved
    assert summary["train_gb"] == 21.5 and summary["train_reserved_gb"] == 23.0
    assert summary["train_device_used_gb"] == 25.0
    assert summary["save_error"] == pytest.approx(0.0) and summary["eval_error"] == pytest.approx(12.0 / 10.0 - 1)
    assert summary["train_error"] == pytest.approx(23.0 / 21.5 - 1)
    # the planner's reserves: fragmentation within 10% of the GPU, the rest outside the allocator within 2 GiB
    assert summary["fragmentation_gb"] == pytest.approx(1.5)
    assert summary["fragmentation_planned_gb"] == pytest.approx(GPU_HEADROOM_FRACTION * 80.0)
    assert summary["outside_allocator_gb"] == pytest.approx(2.0)
    assert summary["outside_allocator_planned_gb"] == pytest.approx(GPU_FIXED_RESERVE / 1e9)


def test_a_case_without_a_phase_peak_is_an_error(gpu_check):
    rows = [row for row in metrics_rows() if "save_peak_memory_gb" not in row]
    assert gpu_check.summarize(rows, {"train": 1.0, "save": 1.0, "eval": 1.0})["error"] == \
        "metrics.jsonl has no save_peak_memory_gb"
    warmup_only = [row for row in metrics_rows() if row["step"] <= WARMUP_STEPS]
    assert "no timed window" in gpu_check.summarize(warmup_only, {})["error"]


def test_a_packed_row_is_planned_at_the_lengths_the_data_gives(gpu_check):
    micro = gpu_check.MICRO
    assert gpu_check.planned_seq([1536] * 50, packing=True) == 1536  # one row of micro x 1536 tokens
    assert gpu_check.planned_seq([1000, 2000, 1500, 1200, 1999, 1100], packing=False) == 2000
    lengths = [1000, 2000, 1500, 1200, 1999, 1100]
    assert gpu_check.planned_seq(lengths, packing=True) == math.ceil(sum(sorted(lengths)[-micro:]) / micro)


def table_rows(gpu_check, planned: dict[str, float]) -> list[dict]:
    summary = gpu_check.summarize(metrics_rows(), planned, 80.0)
    return [{"case": "ddp packed x1", "seconds": 50.0, **summary},
            {"case": "ds_zero3 padded x1", "error": "exit 1: CUDA out of memory; log logs/gpu-check/x.log"}]


def test_the_table_prints_every_figure_and_failed_rows(gpu_check, capsys):
    rows = table_rows(gpu_check, {"train": 23.0, "save": 13.0, "eval": 10.0})
    gpu_check.print_table(rows)
    header, good, failed, reserves = capsys.readouterr().out.splitlines()
    assert header.split() == ["case", "warm-up", "s", "tok/s/GPU", "MFU", "step", "s", "train", "GB", "plan",
                              "save", "GB", "plan", "eval", "GB", "plan", "worst", "reserved", "used"]
    assert good.split() == ["ddp", "packed", "x1", "18.0", "8,000", "35.0%", "1.10", "21.5", "23.0",
                            "12.0", "13.0", "10.0", "10.0", "+8.3%", "23.0", "25.0"]  # worst: the save's 13 / 12
    assert failed == "ds_zero3 padded x1                 FAILED: exit 1: CUDA out of memory; log logs/gpu-check/x.log"
    assert reserves == ("ddp packed x1: reserved - allocated 1.50 GB (planned headroom 8.00), outside the allocator "
                        f"2.00 GB (planned {GPU_FIXED_RESERVE / 1e9:.2f})")
    assert gpu_check.failed_cases(rows) == ["ds_zero3 padded x1"]
    missed = table_rows(gpu_check, {"train": 26.0, "save": 13.0, "eval": 10.0})[:1]  # +12.6%
    assert gpu_check.failed_cases(missed) == ["ddp packed x1"]
    over_reserve = [{**rows[0], "outside_allocator_gb": 3.0}]  # more than GPU_FIXED_RESERVE outside the allocator
    assert gpu_check.failed_cases(over_reserve) == ["ddp packed x1"]


def test_the_levers_case_launches_and_plans_the_same_fields(gpu_check):
    """The levers case's recipe fields become its flags (parsed back to the same values) and its plan's arguments
    (each a parameter of plan(), so the plan counts what the launch turns on)."""
    config, _, packing, levers = next(case for case in gpu_check.CASES if case.levers == gpu_check.LEVERS)
    assert config == "fsdp_full_shard" and packing
    recipe = parse_recipe(Recipe(mixed_precision="bf16"), gpu_check.lever_flags(levers))
    assert {field: getattr(recipe, field) for field in levers} == levers
    assert set(gpu_check.LEVER_PLAN) == set(levers) | set(gpu_check.LIGER)
    assert set(gpu_check.LEVER_PLAN.values()) <= set(inspect.signature(plan).parameters)
    assert gpu_check.case_name(config, 4, packing, levers) == "fsdp_full_shard packed x4 levers"


def test_the_compared_cases_run_first_beside_their_plain_cases(gpu_check):
    """fp8 and Liger (FSDP2 and ZeRO-3, where the head's weight is sharded) and the levers, never run anywhere, come
    before the rest; each compared case has a plain case with the same config, accumulation and packing; the hidden
    states of the Liger and fp8 cases and their plain twins are probed (the levers are compared on losses and
    gradient norms)."""
    names = [gpu_check.case_name(*case) for case in gpu_check.CASES]
    assert len(set(names)) == len(names) == 10
    features = [index for index, case in enumerate(gpu_check.CASES) if case.levers]
    plain_of = {name.removesuffix(gpu_check.compared_suffix(name)) for name in names
                if gpu_check.compared_suffix(name)}
    assert max(features) < min(index for index, name in enumerate(names)
                               if name not in plain_of and not gpu_check.CASES[index].levers)
    liger = [case for case in gpu_check.CASES if case.levers == gpu_check.LIGER]
    assert {case.config for case in liger} == {"fsdp_full_shard", "ds_zero3"}
    recipe = parse_recipe(Recipe(mixed_precision="bf16"), gpu_check.lever_flags(gpu_check.LIGER))
    assert recipe.use_liger_kernel and recipe.chunked_cross_entropy and not recipe.torch_compile
    on_hidden = {name.removesuffix(gpu_check.compared_suffix(name)) for name in names
                 if gpu_check.compared_suffix(name) in (" liger", " fp8")}
    for name in names:
        suffix = gpu_check.compared_suffix(name)
        assert gpu_check.probed(name) == (suffix in (" liger", " fp8") or name in on_hidden)
        if suffix:
            assert name.removesuffix(suffix) in names and suffix in (" liger", " fp8", " levers")
    assert not gpu_check.probed("fsdp_full_shard packed x4 levers") and not gpu_check.probed("ddp padded x1")


def test_the_planner_doc_states_the_tolerances(gpu_check):
    from pathlib import Path

    from shardtune.gpu_check.figures import COMPARED

    text = " ".join((Path(__file__).resolve().parents[3] / "docs" / "planner.md").read_text().split())
    for suffix, name in ((" liger", "Liger"), (" fp8", "fp8")):
        tolerance = COMPARED[suffix]
        assert (f"{name}: gradient norm {tolerance['grad_norm']:.0%}, hidden states {tolerance['hidden']:.0%}, "
                f"losses {tolerance['loss']:.0%}") in text

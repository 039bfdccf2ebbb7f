"""scripts/gpu_check.py's arithmetic, without a GPU: a case's figures from its metrics.jsonl rows (the first
window apart as the warm-up), the lengths a packed row is planned at, and the table, a FAILED row included."""

from __future__ import annotations

import inspect
import math

import pytest

from shardtune.config import Recipe
from shardtune.flags import parse_recipe
from shardtune.plan.planner import plan
from tests.conftest import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def metrics_rows() -> list[dict]:
    """Three windows of two steps (the first compiles), then the export's and the eval's peaks."""
    windows = [(2, 9.0, 1000.0, 0.10, 20.0), (4, 1.0, 9000.0, 0.40, 21.0), (6, 1.2, 7000.0, 0.30, 21.5)]
    rows = [{"step": step, "loss": 3.0, "step_time_s": seconds, "tokens_per_second_per_device": rate, "mfu": mfu,
             "peak_memory_gb": peak} for step, seconds, rate, mfu, peak in windows]
    return rows + [{"step": 6, "save_peak_memory_gb": 12.0}, {"step": 6, "eval_loss": 3.1},
                   {"step": 6, "eval_peak_memory_gb": 10.0}]


def test_a_case_is_summarized_with_its_warmup_apart(gpu_check):
    planned = {"train": 23.0, "save": 12.0, "eval": 12.0}  # metrics.jsonl, the table and the planner speak GB
    summary = gpu_check.summarize(metrics_rows(), planned)
    assert summary["warmup_s"] == 18.0  # the first window: 2 steps of 9 s
    assert summary["tokens_per_second_per_gpu"] == 8000.0 and summary["mfu"] == pytest.approx(0.35)
    assert summary["step_time_s"] == 1.1  # median of the timed windows
    assert summary["train_gb"] == 21.5 and summary["save_error"] == pytest.approx(0.0)
    assert summary["eval_error"] == pytest.approx(12.0 / 10.0 - 1)
    assert summary["train_error"] == pytest.approx(23.0 / 21.5 - 1)


def test_a_case_without_a_phase_peak_is_an_error(gpu_check):
    rows = [row for row in metrics_rows() if "save_peak_memory_gb" not in row]
    assert gpu_check.summarize(rows, {"train": 1.0, "save": 1.0, "eval": 1.0})["error"] == \
        "metrics.jsonl has no save_peak_memory_gb"


def test_a_packed_row_is_planned_at_the_lengths_the_data_gives(gpu_check):
    micro = gpu_check.MICRO
    assert gpu_check.planned_seq([1536] * 50, packing=True) == 1536  # one row of micro x 1536 tokens
    assert gpu_check.planned_seq([1000, 2000, 1500, 1200, 1999, 1100], packing=False) == 2000
    lengths = [1000, 2000, 1500, 1200, 1999, 1100]
    assert gpu_check.planned_seq(lengths, packing=True) == math.ceil(sum(sorted(lengths)[-micro:]) / micro)


def test_the_table_prints_every_figure_and_failed_rows(gpu_check, capsys):
    summary = gpu_check.summarize(metrics_rows(), {"train": 23.0, "save": 13.0, "eval": 10.0})
    rows = [{"case": "ddp packed x1", "seconds": 50.0, **summary},
            {"case": "ds_zero3 padded x1", "error": "exit 1: CUDA out of memory; log logs/gpu-check/x.log"}]
    gpu_check.print_table(rows)
    header, good, failed = capsys.readouterr().out.splitlines()
    assert header.split() == ["case", "warm-up", "s", "tok/s/GPU", "MFU", "step", "s", "train", "GB", "plan",
                              "save", "GB", "plan", "eval", "GB", "plan", "worst"]
    worst = max(23.0 / 21.5 - 1, 13.0 / 12.0 - 1, 10.0 / 10.0 - 1, key=abs)
    assert good.split() == ["ddp", "packed", "x1", "18.0", "8,000", "35.0%", "1.10", "21.5", "23.0",
                            "12.0", "13.0", "10.0", "10.0", f"{worst:+.1%}"]
    assert failed == "ds_zero3 padded x1                 FAILED: exit 1: CUDA out of memory; log logs/gpu-check/x.log"
    assert good.split()[-1] == "+8.3%"  # the save: 13.0 GB planned, 12.0 measured
    assert gpu_check.failed_cases(rows) == ["ds_zero3 padded x1"]
    missed = gpu_check.summarize(metrics_rows(), {"train": 26.0, "save": 13.0, "eval": 10.0})
    assert gpu_check.failed_cases([{"case": "ddp packed x1", **missed}]) == ["ddp packed x1"]  # +12.6%


def test_the_levers_case_launches_and_plans_the_same_fields(gpu_check):
    """The levers case's recipe fields become its flags (parsed back to the same values) and its plan's arguments
    (each a parameter of plan(), so the plan counts what the launch turns on)."""
    config, _, packing, levers = next(case for case in gpu_check.CASES if case[3] == gpu_check.LEVERS)
    assert config == "fsdp_full_shard" and packing
    recipe = parse_recipe(Recipe(mixed_precision="bf16"), gpu_check.lever_flags(levers))
    assert {field: getattr(recipe, field) for field in levers} == levers
    assert set(gpu_check.LEVER_PLAN) == set(levers) | set(gpu_check.LIGER)
    assert set(gpu_check.LEVER_PLAN.values()) <= set(inspect.signature(plan).parameters)
    assert gpu_check.case_name(config, 4, packing, levers) == "fsdp_full_shard packed x4 levers"


def test_the_liger_cases_run_on_sharded_weights_beside_their_plain_cases(gpu_check):
    """Liger's cases (FSDP2 and ZeRO-3, where the head's weight is sharded) launch --use_liger_kernel true, plan it,
    and each has a plain case with the same config, accumulation and packing to compare losses with."""
    liger = [case for case in gpu_check.CASES if case[3] == gpu_check.LIGER]
    assert {config for config, *_ in liger} == {"fsdp_full_shard", "ds_zero3"}
    recipe = parse_recipe(Recipe(mixed_precision="bf16"), gpu_check.lever_flags(gpu_check.LIGER))
    assert recipe.use_liger_kernel and recipe.chunked_cross_entropy and not recipe.torch_compile
    assert set(gpu_check.LIGER.values()) == {True} and set(gpu_check.LIGER) <= set(inspect.signature(plan).parameters)
    names = {gpu_check.case_name(*case) for case in gpu_check.CASES}
    for config, accumulation, packing, levers in liger:
        name = gpu_check.case_name(config, accumulation, packing, levers)
        assert name.endswith(" liger") and name.removesuffix(" liger") in names


def test_a_liger_case_fails_when_its_losses_leave_the_plain_ones(gpu_check, capsys):
    planned = {"train": 23.0, "save": 12.0, "eval": 10.0}
    plain = {"case": "ds_zero3 padded x1", **gpu_check.summarize(metrics_rows(), planned)}
    assert plain["losses"] == [3.0, 3.0, 3.0]
    close = {**plain, "case": "ds_zero3 padded x1 liger", "losses": [3.0, 3.006, 2.997]}
    assert gpu_check.loss_gaps([plain, close]) == {"ds_zero3 padded x1 liger": pytest.approx(0.002)}
    assert gpu_check.failed_cases([plain, close]) == []
    far = {**close, "losses": [3.0, 3.06, 3.0]}  # 2% off
    assert gpu_check.failed_cases([plain, far]) == ["ds_zero3 padded x1 liger"]
    alone = {**close, "case": "fsdp_full_shard padded x4 liger"}  # its plain case did not train: no comparison
    assert gpu_check.failed_cases([plain, alone]) == ["fsdp_full_shard padded x4 liger"]
    gpu_check.print_table([plain, close])
    assert capsys.readouterr().out.splitlines()[-1] == \
        "ds_zero3 padded x1 liger: losses at most 0.20% from ds_zero3 padded x1's (tolerance 1%)"


def test_the_planner_doc_states_the_loss_tolerance(gpu_check):
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text().split())
    tolerance = gpu_check.LOSS_TOLERANCE
    assert (f"a Liger case's losses are more than {tolerance[' liger']:.0%} (fp8: {tolerance[' fp8']:.0%}) off its "
            "plain case's") in text

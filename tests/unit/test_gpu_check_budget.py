"""gpu_check's budget and command line, without a GPU: the deadline counts from the process's start (or the
device command's, --since), a case starts only with time for its minimum, its kill and the closing table, and its
timeout is cut to end within the budget; --cases and --rest pick cases, and are refused in one line on a machine
without CUDA (or when wrong) with nothing written; --rest runs what an earlier command's --out file lacks."""

from __future__ import annotations

import json
import time

import pytest

from shardtune.gpu_check_figures import append_jsonl, earlier_records, new_comparisons, not_run
from tests.conftest import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def test_a_case_gets_its_timeout_cut_to_the_budget_or_does_not_start(gpu_check):
    g = gpu_check
    overhead = 2 * g.KILL_GRACE_S + g.CLOSING_S  # the kill's two grace periods, then the table and the clean-up
    assert g.time_for(g.CASE_TIMEOUT_S, g.BUDGET_S) == g.CASE_TIMEOUT_S
    assert g.time_for(g.COMPILED_TIMEOUT_S, g.BUDGET_S) == g.COMPILED_TIMEOUT_S
    assert g.time_for(g.CASE_TIMEOUT_S, 100) == 100 - overhead  # cut: killed in time to end within the budget
    assert g.time_for(g.CASE_TIMEOUT_S, g.MIN_CASE_S + overhead) == g.MIN_CASE_S
    assert g.time_for(g.CASE_TIMEOUT_S, g.MIN_CASE_S + overhead - 1) is None  # not started
    for left in range(0, g.BUDGET_S + 1, 7):
        given = g.time_for(g.COMPILED_TIMEOUT_S, left)
        assert given is None or (g.MIN_CASE_S <= given and given + overhead <= left)
    # the whole command within 480 s, 2 minutes under the device's 600 s per command
    assert g.BUDGET_S == 480 and g.time_for(g.COMPILED_TIMEOUT_S, g.BUDGET_S) + overhead < g.BUDGET_S
    compiled = [case for case in g.CASES if case.levers.get("torch_compile")]
    assert compiled and all(g.case_limit(case) == g.COMPILED_TIMEOUT_S for case in compiled)


def test_the_deadline_counts_from_the_start_not_from_the_imports(gpu_check):
    assert gpu_check.budget_left(time.time() - 100) == pytest.approx(gpu_check.BUDGET_S - 100, abs=1)
    started = gpu_check.process_start()  # this process's start, before any import
    assert started <= time.time() and gpu_check.budget_left(started) < gpu_check.BUDGET_S


@pytest.mark.parametrize("args", [["--cases", "fsdp_full_shard-padded-x4-fp8,fsdp_full_shard-padded-x4"], []])
def test_without_cuda_it_refuses_in_one_line_and_writes_nothing(gpu_check, args, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    assert gpu_check.main([*args, "--out", str(out), "--log_dir", str(tmp_path / "logs")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "gpu_check: error: no CUDA device is visible; run `make gpu-check` on a GPU machine."] and not captured.out
    assert not out.exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--cases", "ddp-padded-x1,fsdp-fp8"], "gpu_check: error: --cases fsdp-fp8: not a case; give some of "
                                            "fsdp_full_shard-padded-x4-fp8,"),
    (["--rest"], "gpu_check: error: --rest runs the cases the --out file holds no row of: give --out."),
])
def test_bad_arguments_are_refused_in_one_line(gpu_check, args, message, capsys):
    assert gpu_check.main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message)


def test_cases_are_picked_in_priority_order(gpu_check):
    picked = gpu_check.selected_cases("ddp-padded-x1,fsdp_full_shard-padded-x4-fp8")
    assert [gpu_check.case_slug(case) for case in picked] == ["fsdp_full_shard-padded-x4-fp8", "ddp-padded-x1"]
    assert gpu_check.selected_cases(None) == gpu_check.CASES


def test_rest_runs_what_the_first_command_did_not_and_completes_its_comparisons(gpu_check, tmp_path):
    """Each row and each comparison is a JSON line as it ends; a second command reads them back: it runs the cases
    without a row (or cut by the budget) and compares a case of the first command with a plain case of its own."""
    out = tmp_path / "results.jsonl"
    names = [gpu_check.case_name(*case) for case in gpu_check.CASES]
    first = [{"case": names[0], "first_grad_norm": 2.0, "losses": [10.0], "mfu": float("nan")},
             {"case": names[1], "error": "exit 1: boom"},
             {"case": names[2], "error": "not started: the 480 s budget was spent (run it with --rest)"}]
    for row in first:
        append_jsonl(str(out), row)
    records = earlier_records(str(out))
    assert records[0]["mfu"] is None  # NaN written as null: every line is JSON
    assert [gpu_check.case_name(*case) for case in not_run(gpu_check.CASES, records)] == names[2:]
    latest = {record["case"]: record for record in records}
    assert new_comparisons(latest, set()) == []  # the plain case has not trained yet
    latest[names[2]] = {"case": names[2], "first_grad_norm": 2.0, "losses": [10.0]}
    found = new_comparisons(latest, set())
    assert [(item["comparison"], item["plain"]) for item in found] == [(names[0], names[2])]
    assert found[0]["failed"] == ["hidden"]  # not probed: a comparison that did not happen fails
    assert new_comparisons(latest, {names[0]}) == []
    json.loads(out.read_text().splitlines()[0])

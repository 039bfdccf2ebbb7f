"""gpu_check's budget and command line, without a GPU: each kind of case needs its own time (scripts/
device_budget.py), a case starts only with it left (its plain twin's too where that is still to run) before its kill
and the closing, and its timeout is cut to end within the budget; the device tool's two calls fit its 15 minutes
with these times; the device command is the one docs/planner.md gives; --call, --cases and --rest pick cases, and
are refused in one line on a machine without CUDA (or when wrong) with nothing written; --rest runs what an earlier
command's --out file lacks."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from shardtune.gpu_check.figures import append_jsonl, earlier_records, new_comparisons, not_run
from tests.conftest import REPO, load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


@pytest.fixture(scope="module")
def budget(gpu_check):
    import device_budget  # on sys.path once gpu_check is loaded: it sits beside it

    return device_budget


def needs_and_twins(gpu_check, cases: list) -> tuple[list[float], list[int | None]]:
    twins = [gpu_check.plain_twin(case) for case in cases]
    return ([gpu_check.case_needs(case) for case in cases],
            [cases.index(twin) if twin in cases else None for twin in twins])


def test_a_case_gets_its_timeout_cut_to_the_budget_or_does_not_start(budget):
    overhead = 2 * budget.KILL_GRACE_S + budget.CLOSING_S  # the kill's two grace periods, then the closing
    assert budget.time_for(120, 60, 480) == 120
    assert budget.time_for(120, 60, 100) == 100 - overhead  # cut: killed in time to end within the budget
    assert budget.time_for(120, 60, 60 + overhead) == 60
    assert budget.time_for(120, 60, 60 + overhead - 1) is None  # not started: less than its kind needs
    assert budget.time_for(300, 150, 150 + overhead - 1) is None  # a compiled case needs more than a plain one
    for left in range(0, 481, 7):
        given = budget.time_for(300, 150, left)
        assert given is None or (150 <= given and given + overhead <= left)


def test_each_kind_of_case_needs_its_own_time(gpu_check, budget):
    """No flat minimum: a case needs its kind's time, its probe's where its exported model is compared."""
    kinds = {gpu_check.case_slug(case): budget.case_kind(case.config, case.levers) for case in gpu_check.CASES}
    assert kinds == {"fsdp_full_shard-padded-x4-fp8": "fp8", "fsdp_full_shard-padded-x4-liger": "liger",
                     "fsdp_full_shard-padded-x4": "plain", "fsdp_full_shard-packed-x4-levers": "levers",
                     "ds_zero3-padded-x1-liger": "liger", "ds_zero3-padded-x1": "zero3", "ddp-padded-x1": "plain",
                     "ddp-packed-x1": "plain", "fsdp_full_shard-packed-x4": "plain", "ds_zero3-packed-x1": "zero3"}
    for case in gpu_check.CASES:
        probe = budget.PROBE_S if gpu_check.probed(gpu_check.case_name(*case)) else 0
        assert gpu_check.case_needs(case) == budget.KIND_SECONDS[kinds[gpu_check.case_slug(case)]] + probe
    assert budget.KIND_SECONDS["fp8"] > 2 * budget.KIND_SECONDS["plain"] < budget.KIND_SECONDS["levers"]


def test_the_first_call_runs_all_its_cases_within_480_s(gpu_check, budget):
    """fp8, Liger, their plain twin and ZeRO-3 plain, with the install, the model and data and the closing."""
    cases = gpu_check.CALLS[1]
    assert [gpu_check.case_slug(case) for case in cases] == [
        "fsdp_full_shard-padded-x4-fp8", "fsdp_full_shard-padded-x4-liger", "fsdp_full_shard-padded-x4",
        "ds_zero3-padded-x1"]
    needs, twins = needs_and_twins(gpu_check, cases)
    assert twins == [2, 2, None, None]
    assert budget.call_starts(needs, twins, budget.FIRST_CALL_S) == [True] * 4
    assert budget.INSTALL_S + budget.ASSETS_S + sum(needs) + budget.CLOSING_S == 450 <= budget.FIRST_CALL_S == 480
    # its command: SIGTERM 20 s after the budget, SIGKILL 30 s later, within timeout_s, within the tool's 600 s
    timeout = budget.call_timeout(budget.FIRST_CALL_S)
    assert budget.FIRST_CALL_S + budget.TIMEOUT_AFTER_BUDGET_S + budget.TERM_GRACE_S < timeout == 540 \
        <= budget.COMMAND_LIMIT_S


def test_the_second_call_runs_what_the_device_time_left_allows(gpu_check, budget):
    """On a fresh machine after the first was given back: its budget is the device time left less the machine's
    start (up to 2 minutes) and the transfer. Where the first call took its 480 s, 150 s are left: ZeRO-3 plain
    alone; where it took its estimated 450 s and each start 2 minutes, 180 s: the same; where each start took one
    minute, 240 s: ZeRO-3's Liger pair. What it cannot start is a row saying so, for a later session's call."""
    cases = gpu_check.CALLS[2]
    assert {gpu_check.case_slug(case) for case in cases} | {gpu_check.case_slug(case) for case in gpu_check.CALLS[1]} \
        == {gpu_check.case_slug(case) for case in gpu_check.CASES}
    needs, twins = needs_and_twins(gpu_check, cases)
    assert twins == [1, None, 3, None, None, None, None]  # each call runs the plain twin of what it compares
    first = budget.INSTALL_S + budget.ASSETS_S + budget.CLOSING_S + sum(needs_and_twins(gpu_check,
                                                                                        gpu_check.CALLS[1])[0])
    for left, expected_budget, expected in [
            (budget.device_time_left_after(budget.FIRST_CALL_S), 150, [False, True] + [False] * 5),
            (budget.device_time_left_after(first), 180, [False, True] + [False] * 5),
            (budget.DEVICE_TIME_S - 60 - first - budget.TRANSFER_S, 240, [True, True] + [False] * 5)]:
        second = budget.second_call_budget(left)
        assert second == expected_budget and budget.call_starts(needs, twins, second) == expected
    assert budget.second_call_budget(10_000) == budget.FIRST_CALL_S
    for second in range(0, budget.FIRST_CALL_S + 1, 5):
        starts = budget.call_starts(needs, twins, second)
        assert all(twins[index] is None or starts[twins[index]] for index, on in enumerate(starts) if on)
        used = sum(need for need, on in zip(needs, starts, strict=True) if on)
        assert not any(starts) or budget.INSTALL_S + budget.ASSETS_S + used + 2 * budget.KILL_GRACE_S + \
            budget.CLOSING_S <= second


def test_the_device_command_is_the_one_the_planner_doc_gives(budget):
    """Under 2,000 characters; it carries .whl, which git ignores (so only `carry` takes it there); three files in
    $OUT."""
    text = (REPO / "docs" / "planner.md").read_text()
    ignored = subprocess.run(["git", "check-ignore", "-q", ".whl/x.whl"], cwd=REPO).returncode == 0
    assert ignored
    for call, budget_s in ((1, budget.FIRST_CALL_S), (2, 240)):
        command = budget.device_command(call, budget_s)
        assert len(command) < 2000 and command in text, command
        assert f"--call {call} --budget_s {budget_s} " in command and ".whl/*.whl" in command
        assert {word.strip('"') for word in command.split() if "$OUT" in word} == {
            "$OUT/results.jsonl", "$OUT/table.txt", "$OUT/logs.tar.gz"}
    printed = subprocess.run(["python3", str(REPO / "scripts" / "device_budget.py"), "--call", "2",
                              "--budget_left_s", "375"], capture_output=True, text=True, check=True)
    assert json.loads(printed.stdout) == {"carry": [".whl"], "command": budget.device_command(2, 240),
                                          "timeout_s": budget.call_timeout(240)}
    refused = subprocess.run(["python3", str(REPO / "scripts" / "device_budget.py"), "--call", "2",
                              "--budget_left_s", "200"], capture_output=True, text=True)
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1 and not refused.stdout


def test_the_deadline_counts_from_the_start_not_from_the_imports(gpu_check):
    assert gpu_check.budget_left(time.time() - 100, 480) == pytest.approx(380, abs=1)
    started = gpu_check.process_start()  # this process's start, before any import
    assert started <= time.time() and gpu_check.budget_left(started, 480) < 480


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


def test_cases_are_picked_in_priority_order_with_their_plain_twins(gpu_check):
    picked = gpu_check.selected_cases("ddp-padded-x1,fsdp_full_shard-padded-x4-fp8")
    assert [gpu_check.case_slug(case) for case in picked] == ["fsdp_full_shard-padded-x4-fp8",
                                                              "fsdp_full_shard-padded-x4", "ddp-padded-x1"]
    assert gpu_check.selected_cases(None) == gpu_check.CASES
    assert gpu_check.selected_cases(None, 2) == gpu_check.CALLS[2]
    levers = gpu_check.selected_cases("fsdp_full_shard-packed-x4-levers", 2)  # --cases over --call
    assert [gpu_check.case_slug(case) for case in levers] == ["fsdp_full_shard-packed-x4-levers",
                                                              "fsdp_full_shard-packed-x4"]


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

"""gpu_check's time: what each kind of case needs, which cases a budget lets start, and how the device tool's 15
minutes split into its two calls (docs/planner.md, "On the device tool's GPU").

The case times are estimates for one H100 (Llama-3.2-1B's shape, 6 steps of 4 x 2,048-token micro-batches, eval,
export): the launch's imports and the model's load are most of a plain case; Liger adds its Triton kernels' first
compilations; the levers and fp8 compile the decoder layers (and fp8 torchao's casts) before the first step. A case
starts only with its kind's time (and its probe's, and its plain twin's where that is still to run) left before the
kill and the closing; its process is killed at twice that, or where the budget ends. A row's "seconds" is the
measured time: put it here after a run on the device.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shardtune from this checkout
from shardtune.checks.command_line import OneLineParser  # noqa: E402
from shardtune.gpu_check.processes import KILL_GRACE_S  # noqa: E402

# Seconds, estimated: one case of each kind (launch to exit), a probe of its exported model, writing the model and
# data, installing the carried wheels, the closing (table, archive, removal of the temporary model).
KIND_SECONDS = {"plain": 45, "zero3": 55, "liger": 65, "levers": 150, "fp8": 150}
PROBE_S, ASSETS_S, INSTALL_S, CLOSING_S = 20, 30, 10, 15
LIMIT_FACTOR = 2  # a case is killed at this many times its kind's time
# The device tool: 15 minutes of device time a session, machine starts (1 to 2 minutes each) included; 10 minutes a
# command; the results copied back after the command (TRANSFER_S).
DEVICE_TIME_S, MACHINE_START_S, COMMAND_LIMIT_S, TRANSFER_S = 900, 120, 600, 15
FIRST_CALL_S = 480  # the first call's budget, from the command's start (the install included)
# The outer `timeout` of the device command: SIGTERM this long after the budget's end (the check ends before unless
# it hangs), SIGKILL TERM_GRACE_S later (the check's own kill of its case and its closing fit in it).
TIMEOUT_AFTER_BUDGET_S, TERM_GRACE_S = 20, 30


def case_kind(config: str, levers: dict) -> str:
    if levers.get("mixed_precision") == "fp8":
        return "fp8"
    if levers.get("use_liger_kernel"):
        return "liger"
    if levers.get("torch_compile"):
        return "levers"
    return "zero3" if config.startswith("ds_") else "plain"


def case_seconds(config: str, levers: dict, probed: bool) -> float:
    """What a case needs: its kind's time and, where its exported model is probed, the probe's."""
    return KIND_SECONDS[case_kind(config, levers)] + (PROBE_S if probed else 0)


def time_for(limit: float, needs: float, left: float) -> float | None:
    """How long a step with its own `limit` may run when `left` seconds of the budget remain: the limit, cut so
    that its kill and the closing still end within the budget; None (not started) where that leaves less than
    `needs`, what the step's kind needs."""
    usable = left - 2 * KILL_GRACE_S - CLOSING_S
    return min(limit, usable) if usable >= needs else None


def budget_left(since: float, budget: float) -> float:
    """Seconds of `budget` left, counted from `since` (Unix time)."""
    return budget - (time.time() - since)


def planned_starts(needs: list[float], twins: list[int | None], left: float) -> list[bool]:
    """Which of a call's cases start when each takes what it needs (`needs`, in order; `twins[i]`: the index of
    case i's plain twin where it is compared, else None) and `left` seconds remain after the install and the
    assets: a case starts where its time, and its twin's if the twin has not run yet, fit before the kill and the
    closing; a compared case whose twin did not run is not started (its comparison could not be made); a case not
    started leaves its time to the next."""
    started = [False] * len(needs)
    for index, seconds in enumerate(needs):
        twin = twins[index]
        if twin is not None and twin < index and not started[twin]:
            continue
        extra = needs[twin] if twin is not None and twin > index else 0
        if time_for(seconds, seconds + extra, left) is not None:
            started[index] = True
            left -= seconds
    return started


def second_call_budget(budget_left_s: float) -> int:
    """The second call's budget, from the device time left before it (the tool's status, budget_left_s): the machine's
    start and the results' transfer come out of the same time; at most FIRST_CALL_S."""
    return int(min(FIRST_CALL_S, budget_left_s - MACHINE_START_S - TRANSFER_S))


def device_time_left_after(call_s: float, budget_left_s: float = DEVICE_TIME_S) -> float:
    """The device time left after a call on a fresh machine that ran `call_s` seconds and was given back."""
    return budget_left_s - MACHINE_START_S - call_s - TRANSFER_S


def call_starts(needs: list[float], twins: list[int | None], budget: float) -> list[bool]:
    """planned_starts for a whole call of `budget` seconds: the install and the assets first."""
    return planned_starts(needs, twins, budget - INSTALL_S - ASSETS_S)


def call_timeout(budget: float) -> int:
    """The device call's timeout_s: the budget, the outer timeout's grace after it, its SIGKILL's, 10 s to spare."""
    return int(budget + TIMEOUT_AFTER_BUDGET_S + TERM_GRACE_S + 10)


def device_command(call: int, budget: int) -> str:
    """The device call's command: the carried wheels installed into /tmp/site (`carry` must name .whl: it is
    ignored by git), then the check under an outer `timeout` (SIGTERM at the budget's end plus
    TIMEOUT_AFTER_BUDGET_S, SIGKILL TERM_GRACE_S later), writing its three files straight into $OUT as each case
    ends and on SIGTERM."""
    return ("S=$(date +%s); python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "
            "/tmp/site .whl/*.whl || exit 3; PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD timeout -k "
            f"{TERM_GRACE_S} $((S + {budget + TIMEOUT_AFTER_BUDGET_S} - $(date +%s))) python3 scripts/gpu_check.py "
            f'--call {call} --budget_s {budget} --since $S --out "$OUT/results.jsonl" --table "$OUT/table.txt" '
            '--archive "$OUT/logs.tar.gz"')


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description="Print the device call's arguments (carry, command, timeout_s) as "
                                     "JSON: the first call's, or the second's for the device time left.")
    parser.add_argument("--call", type=int, choices=(1, 2), required=True,
                        help="the first call (its fixed budget) or the second (from --budget_left_s)")
    parser.add_argument("--budget_left_s", type=float, default=DEVICE_TIME_S,
                        help="the device tool's status budget_left_s before this call (default: %(default)s)")
    args = parser.parse_or_exit(argv)
    budget = FIRST_CALL_S if args.call == 1 else second_call_budget(args.budget_left_s)
    if budget < INSTALL_S + ASSETS_S + CLOSING_S + 2 * KILL_GRACE_S + min(KIND_SECONDS.values()):
        print(f"device_budget: error: {args.budget_left_s:.0f} s of device time leave a {budget} s budget, too "
              "little for any case: run this call in a later session.", file=sys.stderr)
        return 1
    print(json.dumps({"carry": [".whl"], "command": device_command(args.call, budget),
                      "timeout_s": call_timeout(budget)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Machines of one job started differently (accelerate config, flags) stop together at start-up, naming what
differs. Multi-machine training itself, on loopback, is tested in tests/launch/test_checkpoint.py: two launchers
of one process each, killed and resumed, give the per-step losses of one launcher with two processes, bit for
bit."""

from __future__ import annotations

import re
import time

from tests.conftest import machine_log, start_machines, wait_all

CONFIG_EXIT_CODE = 2  # docs/errors.md's code for a run refused at start-up (shardtune.cli)
# The figure of docs/multinode.md: the machines' launchers exit within this of each other (both ranks stop at the same
# fingerprint exchange; the rest is each launcher noticing its rank's exit).
STOP_SPREAD_S = 5


def test_machines_started_differently_stop_at_start_up(tiny_assets, tmp_path):
    """Machine 0 runs ZeRO-2 with --max_seq_length 64, machine 1 ZeRO-3 with 48. Both must stop within seconds of
    each other, before a single step, each log with one message naming both keys and both machines."""
    output_dir = tmp_path / "out"
    started = time.monotonic()
    machines = start_machines(output_dir, tiny_assets, "--max_steps", "4", configs=["ds_zero2", "ds_zero3"],
                              machine_args=[("--max_seq_length", "64"), ("--max_seq_length", "48")])
    exit_times = wait_all(machines, timeout=300, started=started)
    assert all(machine.returncode != 0 for machine in machines)
    for machine in (0, 1):  # each machine's log says why it stopped, and its rank exited with code 2
        log = machine_log(output_dir, machine)
        assert re.search(rf"exitcode\s*:\s*{CONFIG_EXIT_CODE}\b", log), log[-4000:]
        error_lines = [line for line in log.splitlines() if line.startswith("shardtune: error:")]
        assert len(error_lines) == 1, log[-4000:]
        for expected in ("deepspeed.stage: '2' on machine 0 (", "'3' on machine 1 (",
                         "recipe.max_seq_length: '64' on machine 0 (", "'48' on machine 1 ("):
            assert expected in error_lines[0], error_lines[0]
        # The only traceback is the launcher's own report that its rank exited non-zero.
        assert log.count("Traceback") == log.count("ChildFailedError:") == 1, log[-4000:]
    assert not (output_dir / "metrics.jsonl").exists()  # stopped before training
    print(f"mismatch: machines exited {exit_times} s after launch")
    assert max(exit_times) - min(exit_times) < STOP_SPREAD_S



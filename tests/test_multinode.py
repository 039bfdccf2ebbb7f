"""Machines of one job started differently (accelerate config, flags) stop together at start-up, naming what
differs. Multi-machine training itself, on loopback, is tested in test_checkpoint: two launchers of one process
each, killed and resumed, give the per-step losses of one launcher with two processes, bit for bit."""

from __future__ import annotations

import time

from tests.conftest import machine_log, start_machines, wait_all

MISMATCHES = {  # machine configs, per-machine flags, what the message must name
    "zero stage": (["ds_zero2", "ds_zero3"], [(), ()],
                   "ACCELERATE_DEEPSPEED_ZERO_STAGE: '2' on machine 0 ("),
    "flag": (["fsdp_full_shard"] * 2, [("--max_seq_length", "64"), ("--max_seq_length", "48")],
             "recipe.max_seq_length: '64' on machine 0 ("),
}


def test_machines_started_differently_stop_at_start_up(tiny_assets, tmp_path):
    """Both mismatches run at once (four launchers): each pair must stop on its own, within seconds of each
    other, before a single step, with one message naming the key and both machines."""
    started = time.monotonic()
    runs = {case: start_machines(tmp_path / case.replace(" ", "-"), tiny_assets, "--max_steps", "4",
                                 configs=configs, machine_args=flags)
            for case, (configs, flags, _) in MISMATCHES.items()}
    exit_times = {case: wait_all(machines, timeout=300, started=started) for case, machines in runs.items()}
    for case, (_, _, message) in MISMATCHES.items():
        output_dir = tmp_path / case.replace(" ", "-")
        assert all(machine.returncode != 0 for machine in runs[case]), case
        for machine in (0, 1):  # each machine's log says why it stopped
            log = machine_log(output_dir, machine)
            error_lines = [line for line in log.splitlines() if line.startswith("shardtune: error:")]
            assert len(error_lines) == 1, log[-4000:]
            assert message in error_lines[0] and "on machine 1 (" in error_lines[0], error_lines[0]
            # The only traceback is the launcher's own report that its rank exited non-zero.
            assert log.count("Traceback") == log.count("ChildFailedError:") == 1, log[-4000:]
        assert not (output_dir / "metrics.jsonl").exists()  # stopped before training
        assert max(exit_times[case]) - min(exit_times[case]) < 15, exit_times[case]
    print("mismatch: seconds from launch to exit per machine:", exit_times)

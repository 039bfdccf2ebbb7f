"""A run resumes on another number of processes as the same run: a 2-process checkpoint resumed on 4 processes,
and that run's checkpoint resumed on 2 again, train the uninterrupted 2-process run's steps (DDP, FSDP2, ZeRO-1/2/3):
per-step losses and gradient norms within 1e-5, and every step the same rows, row for row. The global batch of 32
is kept (micro-batch 8 x 2 accumulation x 2 ranks, then 8 x 1 x 4), the data order continues from the same row,
and the schedule and Adam's step count continue (a restarted schedule or bias correction shows in the losses).
ZeRO-1, 2 and 3 the same, through DeepSpeed's universal checkpoint, converted once into the resuming run's output
directory (the 2-process checkpoint, another run's, left as it was; the 4-process one, the run's own, inside it),
its host RAM planned before it starts and its measured peak within 10% of the plan; ZeRO-3 with the optimizer in
CPU RAM too. ZeRO-1 and FSDP2's SHARD_GRAD_OP are grown only, for the suite's time: each loads as a config shrunk
here does (ZeRO-2's optimizer and universal load, FULL_SHARD's resharding distributed checkpoint). NVMe offload is
refused at another size, in one line before anything loads."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from shardtune.data.batches import TRACE_ROWS_ENV
from tests.conftest import (
    REFERENCE_ARGS,
    grad_norms,
    made_once,
    nvme_args,
    read_metrics,
    run_recipe,
    train_losses,
)

# The reference runs (tests/conftest.py): 2 processes, 8 steps of 32 rows, a checkpoint every 2 steps.
GROWN_FROM, SHRUNK_FROM, STEPS = 4, 6, 8
TOLERANCE = 1e-5  # the same global batches, reduced over other ranks and micro-batches: rounding only
# Their shrink would load as ds_zero2's and fsdp_full_shard's does (DeepSpeedZeroOptimizer's universal load for
# ZeRO-1 and 2; DCP's reshard for both FSDP2 configs): one launch fewer each.
GROWN_ONLY = ("ds_zero1", "fsdp_shard_grad_op")
PLANNED_RAM = 0.10  # the conversion's measured peak host RAM against its plan


def rows_by_step(trace: Path) -> dict[int, list[str]]:
    """The rows every rank trained at each step (their digests, shardtune.data.batches.row_digests), over all ranks."""
    steps = defaultdict(list)
    for path in trace.glob("rows-rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps[record["step"]].extend(record["rows"])
    return {step: sorted(rows) for step, rows in steps.items()}


@pytest.fixture(scope="module")
def uninterrupted_rows(tiny_assets, tmp_path_factory) -> dict[int, list[str]]:
    """The rows of each step of an uninterrupted run: one process, 8 x 4 accumulation (the order is the seeded
    shuffle cut into global batches, the same on any number of processes: this is what the resumes must match)."""

    def make(root: Path) -> None:
        run_recipe(root / "out", tiny_assets, *REFERENCE_ARGS, "--save_steps", "0", "--save_model", "false",
                   env={TRACE_ROWS_ENV: str(root / "rows")})

    return rows_by_step(made_once(tmp_path_factory, "rows-uninterrupted", make) / "rows")


def steps_from(output_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(output_dir) if "loss" in row]


def source_state(checkpoint: Path) -> dict[str, tuple[int, int]]:
    """Every file below `checkpoint` with its size and modification time: what a conversion must leave alone."""
    return {str(path.relative_to(checkpoint)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(checkpoint.rglob("*"))}


def check_conversion(stdout: str, source: Path, output_dir: Path) -> None:
    """Converted into `output_dir`: beside `source` where it is that run's own checkpoint (listed in its marker),
    else into `universal-checkpoint-<step>` with a marker of its own, the source left alone; planned before it
    started, within PLANNED_RAM of its planned peak host RAM."""
    lines = stdout.splitlines()
    converting = next(index for index, line in enumerate(lines) if "converting" in line)
    planned = lines[converting - 1]
    assert re.match(rf"shardtune: planned conversion of {re.escape(str(source))} \([24] ranks' ZeRO files, .*\): "
                    r"peak host RAM .* in one process \(interpreter .*\), about \d+s$", planned), planned
    inside = source.parent == output_dir
    target = source / "universal" if inside else output_dir / f"universal-checkpoint-{source.name.split('-')[1]}"
    assert f"converting {source} to DeepSpeed's universal checkpoint ({target})" in lines[converting]
    assert (target / "pytorch_model" / "zero").is_dir() and (source / "universal").exists() == inside
    marked = source if inside else target
    marker = json.loads((marked / "checkpoint_complete.json").read_text())
    assert marker.get("converted_from") == (None if inside else str(source.resolve()))
    assert {name for name in marker["files"] if not inside or name.startswith("universal/")} == {
        str(path.relative_to(marked)) for path in target.rglob("*")
        if path.is_file() and path.name != "checkpoint_complete.json"}
    done = next(line for line in lines if line.startswith("shardtune: converted in"))
    measured, plan = (float(value) * {"MB": 1e6, "GB": 1e9}[unit] for value, unit in
                      re.findall(r"([\d.]+) (MB|GB)", done.split("peak host RAM", 1)[1]))
    assert plan == pytest.approx(measured, rel=PLANNED_RAM), done


@pytest.mark.parametrize("config", ["ddp", "fsdp_full_shard", "fsdp_shard_grad_op", "ds_zero1", "ds_zero2",
                                    "ds_zero3", "ds_zero3_offload_optimizer"])
def test_resume_on_other_world_sizes_continues_the_run(config, reference_run, uninterrupted_rows, tiny_assets,
                                                       tmp_path):
    reference = reference_run(config)
    reference_losses, reference_norms = train_losses(reference), grad_norms(reference)
    assert len(uninterrupted_rows) == STEPS and all(len(rows) == 32 for rows in uninterrupted_rows.values())

    # 2 -> 4 processes at step 4, into a directory of its own: steps 5 to 8, from the shared reference's checkpoint,
    # which a DeepSpeed resume converts into the new run's directory.
    source = reference / f"checkpoint-{GROWN_FROM}"
    before = source_state(source)
    grown = tmp_path / "grown"
    result = run_recipe(grown, tiny_assets, *REFERENCE_ARGS, "--resume_from_checkpoint", str(source),
                        config=config, processes=4, env={TRACE_ROWS_ENV: str(tmp_path / "rows-grown")})
    assert source_state(source) == before
    resumed_line = next(line for line in result.stdout.splitlines() if "resumed from" in line)
    assert ("4 processes where the checkpoint had 2: micro-batch 8 x 1 accumulation x 4 data ranks where it had "
            "micro-batch 8 x 2 accumulation x 2 data ranks; kept: the global batch of 32, the data order after the "
            "128 rows of its 4 steps") in resumed_line, resumed_line
    assert "global batch 32 = 8 x 1 accumulation x 4 ranks" in result.stdout
    deepspeed = config.startswith("ds_")
    assert (f"converting {source} to DeepSpeed's universal checkpoint" in result.stdout) == deepspeed
    if deepspeed:
        check_conversion(result.stdout, source, grown)
    assert steps_from(grown) == list(range(GROWN_FROM + 1, STEPS + 1))
    assert train_losses(grown) == pytest.approx(reference_losses[GROWN_FROM:], rel=TOLERANCE, abs=TOLERANCE)
    assert grad_norms(grown) == pytest.approx(reference_norms[GROWN_FROM:], rel=TOLERANCE, abs=TOLERANCE)
    grown_rows = rows_by_step(tmp_path / "rows-grown")
    assert grown_rows == {step: uninterrupted_rows[step] for step in range(GROWN_FROM + 1, STEPS + 1)}
    if config in GROWN_ONLY:
        return

    # 4 -> 2 processes at step 6, the 4-process run's own checkpoint resumed in its own directory (a DeepSpeed one
    # converted inside it): steps 7 and 8 again.
    result = run_recipe(grown, tiny_assets, *REFERENCE_ARGS, "--resume_from_checkpoint",
                        str(grown / f"checkpoint-{SHRUNK_FROM}"), config=config, processes=2,
                        env={TRACE_ROWS_ENV: str(tmp_path / "rows-shrunk")})
    assert "2 processes where the checkpoint had 4: micro-batch 8 x 2 accumulation x 2 data ranks" in result.stdout
    if deepspeed:
        check_conversion(result.stdout, grown / f"checkpoint-{SHRUNK_FROM}", grown)
    assert steps_from(grown) == list(range(GROWN_FROM + 1, STEPS + 1))
    resumed = SHRUNK_FROM - GROWN_FROM  # the rows of steps 7 and 8, logged again after the truncation
    shrunk_losses, shrunk_norms = train_losses(grown)[resumed:], grad_norms(grown)[resumed:]
    assert shrunk_losses == pytest.approx(reference_losses[SHRUNK_FROM:], rel=TOLERANCE, abs=TOLERANCE)
    assert shrunk_norms == pytest.approx(reference_norms[SHRUNK_FROM:], rel=TOLERANCE, abs=TOLERANCE)
    assert rows_by_step(tmp_path / "rows-shrunk") == {step: uninterrupted_rows[step]
                                                      for step in range(SHRUNK_FROM + 1, STEPS + 1)}


def test_an_nvme_offloaded_checkpoint_on_another_number_of_processes_is_refused(reference_run, tiny_assets,
                                                                                 tmp_path):
    """DeepSpeed 0.19 restores an NVMe-offloaded optimizer from each rank's own swap files, never from the universal
    checkpoint: the 2-process checkpoint on one process (a DeepSpeed launch all the same) is refused in one line,
    before anything loads or is written, exit 2."""
    config = "ds_zero3_nvme_offload"
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, *nvme_args(config, tmp_path),
                        "--resume_from_checkpoint", str(reference_run(config) / f"checkpoint-{GROWN_FROM}"),
                        config=config, processes=1, check=False)
    assert result.returncode != 0, result.stdout[-3000:]
    errors = {line for line in result.stderr.splitlines() if line.startswith("shardtune: error: ")}
    (line,) = errors
    assert ("saved by 2 processes and this DeepSpeed launch has 1: a resume on another number of processes with "
            "states offloaded to NVMe is not supported: DeepSpeed 0.19 restores NVMe-offloaded optimizer states "
            "from each rank's own swap files") in line and "--num_processes 2" in line, line
    assert not (output_dir / "metrics.jsonl").exists() and "converting" not in result.stdout

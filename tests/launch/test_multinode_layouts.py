"""The multi-machine layouts on loopback, 2 machines x 2 processes: FSDP2's hybrid sharding (fsdp_hybrid_shard.yaml,
a (replicate 2, shard 2) mesh) and ZeRO++'s hierarchical partitioning (ds_zero3_hpz.yaml, the hpZ group the 2
processes of a machine). Each trains the reference run's 8 fp32 steps as one machine does (fsdp_full_shard.yaml,
the shared reference run: 2 processes, the same global batch): the same losses, gradient norms and final weights;
and each rank holds the model states the planner plans for that layout, measured on the live objects at the first
step (shardtune.memory)."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.models.flops import resolve_model
from shardtune.plan.hardware import Hardware
from shardtune.plan.planner import plan
from shardtune.plan.strategy import Strategy
from tests.conftest import (
    REFERENCE_ARGS,
    grad_norms,
    machine_log,
    read_metrics,
    run_recipe,
    start_machines,
    strategy_as_launched,
    train_losses,
    wait_all,
)
from tests.launch.test_batch_split import WEIGHT_ATOL, WEIGHT_RTOL
from tests.launch.test_memory_measured import EXACT_RTOL, GRADIENT_RTOL, held
from tests.launch.test_strategies import FP32_RTOL

MACHINES, PROCESSES_PER_MACHINE = 2, 2
# The reference run's arguments (global batch 32: micro-batch 8 on each of the 4 ranks, no accumulation), a
# checkpoint every 3 steps (checkpoint-3 resumed on one machine below: after 3 micro-batches, at 2 per step on one
# machine, so a micro-batch count carried over from the checkpoint would sync mid-step) and the final export,
# gathered from the layout's shards.
RESUMED_AT = 3
LAYOUT_ARGS = (*REFERENCE_ARGS, "--save_steps", str(RESUMED_AT))
RESIZED_TOLERANCE = 1e-5  # the same global batches on 2 ranks instead of 4: rounding only
# accelerate launch's sizes for 2 x 2: the YAML's dp_replicate_size is 2 (nodes), its dp_shard_size 8 (a node).
LAUNCH_ARGS = {"fsdp_hybrid_shard": ("--parallelism_config_dp_shard_size", str(PROCESSES_PER_MACHINE)),
               "ds_zero3_hpz": ()}
LAYOUTS = tuple(LAUNCH_ARGS)
# The 4 CPU "GPUs" the planner sees: 2 machines of 2 (the memory is irrelevant here).
LOOPBACK = Hardware(MACHINES, PROCESSES_PER_MACHINE, 80 * 10**9, None, "2x2 loopback")


def launched_strategy(config: str) -> Strategy:
    """The planner's Strategy as LAUNCH_ARGS launch it: hybrid sharding over a machine's processes."""
    strategy = strategy_as_launched(config)
    return dataclasses.replace(strategy, shard_group=PROCESSES_PER_MACHINE) if strategy.kind == "fsdp" else strategy


@pytest.fixture(scope="module")
def one_machine(reference_run) -> Path:
    """One machine, FSDP2 FULL_SHARD over its 2 processes, the same global batch: the run both layouts must
    equal (the number of ranks only changes the order of float sums, tests/launch/test_batch_split.py)."""
    return reference_run("fsdp_full_shard")


@pytest.fixture(scope="module")
def layout_run(tiny_assets, tmp_path_factory):
    """layout_run(config) -> output dir of that layout's 2 x 2 loopback run, run once."""
    done: dict[str, Path] = {}

    def run(config: str) -> Path:
        if config not in done:
            output_dir = tmp_path_factory.mktemp(f"layout-{config}") / "out"
            started = time.monotonic()
            machines = start_machines(output_dir, tiny_assets, *LAYOUT_ARGS, configs=[config] * MACHINES,
                                      processes_per_machine=PROCESSES_PER_MACHINE, launch_args=LAUNCH_ARGS[config])
            wait_all(machines, timeout=600, started=started)
            print(f"{MACHINES} x {PROCESSES_PER_MACHINE} {config}: {time.monotonic() - started:.1f} s")
            for machine in range(MACHINES):
                assert machines[machine].returncode == 0, machine_log(output_dir, machine)[-6000:]
            done[config] = output_dir
        return done[config]

    return run


@pytest.mark.parametrize("config", LAYOUTS)
def test_layout_on_two_machines_trains_as_one_machine(config, layout_run, one_machine):
    """fp32: the layouts only change which ranks sum which gradients (hybrid sharding reduce-scatters within a
    machine and all-reduces across; hpZ gathers from the secondary copy), which moves a loss or a gradient norm
    by about 1e-7 per step: FP32_RTOL, as between the strategies on one machine. The weights as between ranks
    counts (WEIGHT_RTOL: Adam turns summation noise of near-zero gradient elements into visible steps)."""
    output_dir = layout_run(config)
    losses, reference = train_losses(output_dir), train_losses(one_machine)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    assert losses == pytest.approx(reference, rel=FP32_RTOL)
    assert grad_norms(output_dir) == pytest.approx(grad_norms(one_machine), rel=FP32_RTOL)
    weights = load_file(output_dir / "model.safetensors")
    reference_weights = load_file(one_machine / "model.safetensors")
    assert weights.keys() == reference_weights.keys()
    for key, tensor in reference_weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=f"{config}: {key}")


@pytest.mark.parametrize("config", LAYOUTS)
def test_each_rank_holds_the_planned_states_of_its_layout(config, layout_run, one_machine, tiny_assets):
    """Hybrid sharding holds 1/2 of the states (sharded over a machine's 2 ranks), twice FSDP's 1/4 on the one
    machine; hpZ holds ZeRO-3's 1/4 partitions plus the secondary copy of the weights, 1/2 of them. The plan
    of each layout on 2 x 2 is what the largest rank holds; the one-machine run checks the contrast."""
    shape = resolve_model(tiny_assets[0])
    planned = plan(shape, LOOPBACK, launched_strategy(config), micro_batch=8, seq=64, checkpointing=False)
    measured = held(layout_run(config))
    assert measured["weights"] == pytest.approx(planned.per_gpu["weights"], rel=EXACT_RTOL)
    assert measured["gradients"] == pytest.approx(planned.per_gpu["gradients"], rel=GRADIENT_RTOL)
    assert measured["optimizer"] == pytest.approx(planned.per_gpu["optimizer"], rel=EXACT_RTOL)
    flat = held(one_machine)["weights"] / 2  # fp32 weights sharded over its 2 ranks; over 4, half that
    assert flat == pytest.approx(4 * shape.params / 4, rel=EXACT_RTOL)
    # hybrid: 4P/2; hpZ: 4P/4 + the secondary 4P/2 (fp32 here: the module's dtype)
    assert measured["weights"] == pytest.approx({"fsdp_hybrid_shard": 2, "ds_zero3_hpz": 3}[config] * flat,
                                                rel=EXACT_RTOL)
    assert planned.layout == {"fsdp_hybrid_shard": "sharded over 2 GPUs, replicated x2",
                              "ds_zero3_hpz": "sharded over 4 GPUs, a copy of the weights sharded over 2"}[config]
    if config == "fsdp_hybrid_shard":  # the start-up line names the mesh
        assert re.search(r"FSDP2 FULL_SHARD over 2 ranks, replicated x2", machine_log(layout_run(config), 0))


def test_two_machines_resumed_on_one(layout_run, tiny_assets, tmp_path):
    """The 2 x 2 hybrid-sharded run's checkpoint-3 resumed on one machine of 2 processes, under the same config as
    train.sbatch launches it on the one node a requeue got (replicate 1 x shard 2): torch.distributed.checkpoint
    reshards the (replicate 2, shard 2) states onto the (1, 2) mesh, the global batch of 32 is kept (8 x 2
    accumulation x 2 ranks) and steps 4 to 8 are the two machines' own, within 1e-5."""
    two_machines = layout_run("fsdp_hybrid_shard")
    output_dir = tmp_path / "one-machine"
    result = run_recipe(output_dir, tiny_assets, *LAYOUT_ARGS, "--resume_from_checkpoint",
                        str(two_machines / f"checkpoint-{RESUMED_AT}"), config="fsdp_hybrid_shard", processes=2,
                        launch_args=("--parallelism_config_dp_replicate_size", "1",
                                     "--parallelism_config_dp_shard_size", "2"))
    assert ("2 processes where the checkpoint had 4: micro-batch 8 x 2 accumulation x 2 data ranks where it had "
            "micro-batch 8 x 1 accumulation x 4 data ranks; kept: the global batch of 32, the data order after the "
            "96 rows of its 3 steps") in result.stdout, \
        result.stdout[-3000:]
    assert [row["step"] for row in read_metrics(output_dir) if "loss" in row] == list(range(RESUMED_AT + 1, 9))
    assert train_losses(output_dir) == pytest.approx(train_losses(two_machines)[RESUMED_AT:],
                                                     rel=RESIZED_TOLERANCE, abs=RESIZED_TOLERANCE)
    assert grad_norms(output_dir) == pytest.approx(grad_norms(two_machines)[RESUMED_AT:],
                                                   rel=RESIZED_TOLERANCE, abs=RESIZED_TOLERANCE)

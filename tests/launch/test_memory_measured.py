"""The planner's model states against what each rank really holds. Every shipped config's 2-process reference
run (fp32) measures its weights, gradients and optimizer states on the live objects at the first step
(shardtune.memory) and logs the largest rank's bytes; the planner predicts them from the config alone. The 3-rank
bf16 runs (conftest.three_rank_run) measure ZeRO-1, -2 and -3 where their formulas part from that reference: bf16
(fp32 gradient accumulation beside 16-bit weights), 3 ranks (uneven partitions), and a sub_group_size that cuts
each rank's partition into several optimizer sub-groups, as sub_group_size does for a 70B model."""

from __future__ import annotations

import pytest

from shardtune.memory import COMPONENTS
from shardtune.models.flops import resolve_model
from shardtune.plan.buffers import buffers
from shardtune.plan.states import deepspeed_sizes, largest_sub_group, model_states, persistent_elements
from shardtune.plan.strategy import Strategy
from tests.conftest import THREE_RANK_CONFIGS, THREE_RANKS, read_metrics, strategy_as_launched
from tests.launch.test_strategies import CONFIG_NAMES

# The figures of docs/planner.md. Weights and optimizer states: exact up to Adam's step counters (4 bytes per
# tensor) and, under ZeRO, how each parameter group's flat buffer splits over the ranks (-0.33% off the even share
# here).
EXACT_RTOL = 4e-3
# Gradients: exact but for a few alignment elements of ZeRO's partitions (+0.03% here).
GRADIENT_RTOL = 1e-3
# Offload configs hold everything in host RAM, which on a CPU machine is the "device" too: totals are compared.
OFFLOAD_RTOL = 0.05
# DeepSpeed's reduce buckets, allocated whole: exact. Under ZeRO-2 the probe finds no bucket at the first step
# (0 bytes): there the buffer is planned, not measured.
BUFFER_RTOL = 1e-3
BUFFERS_NOT_MEASURED = {"ds_zero2"}

def held(output_dir) -> dict[str, int]:
    (row,) = [row for row in read_metrics(output_dir) if "held_weights_bytes" in row]
    return {key: row[f"held_{key}_bytes"] for key in COMPONENTS}


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_model_states_equal_the_bytes_each_rank_holds(config, reference_run, tiny_assets):
    measured = held(reference_run(config))
    strategy = strategy_as_launched(config)
    shape = resolve_model(tiny_assets[0])
    params = shape.params
    planned = model_states(strategy, params, world=2, shape=shape)
    offloaded = planned.host + planned.nvme
    if not offloaded:
        assert measured["weights"] == pytest.approx(planned.weights, rel=EXACT_RTOL)
        assert measured["optimizer"] == pytest.approx(planned.optimizer, rel=EXACT_RTOL)
        assert measured["gradients"] == pytest.approx(planned.gradients, rel=GRADIENT_RTOL)
    elif "nvme" not in config:  # on a CPU machine the host and the "GPU" are the same memory: compare totals
        total = measured["weights"] + measured["gradients"] + measured["optimizer"]
        assert total == pytest.approx(planned.weights + planned.gradients + planned.optimizer + offloaded,
                                      rel=OFFLOAD_RTOL)
    else:  # NVMe: Adam's states and the fp32 master live in swap files; in host RAM the gradient partitions and
        # the weight partitions (a flat buffer per group, up to max_in_cpu elements: here all of them)
        weight_partitions = 4 * params / 2
        assert planned.nvme == 12 * params / 2 and planned.host == pytest.approx(8 * params / 2 + weight_partitions)
        assert measured["gradients"] == pytest.approx(planned.host - weight_partitions, rel=GRADIENT_RTOL)
        # DeepSpeed swapped under --offload_nvme_path (it deletes the files at exit, the folders stay).
        swap_root = reference_run(config).parent / "nvme" / "zero_stage_3"
        assert {path.name for path in swap_root.iterdir()} == {"optimizer", "float32params"}
    if strategy.kind == "fsdp":  # placement, by FSDP's own bookkeeping (FSDPParam.offload_to_cpu)
        assert measured["host"] == pytest.approx(planned.host, rel=EXACT_RTOL, abs=64)
        assert (measured["host"] > 0) == (strategy.offload_params == "cpu")
    if strategy.kind == "deepspeed":
        # Placement, by DeepSpeed's own bookkeeping: what the planner puts in host RAM is what DeepSpeed put there.
        # Under NVMe offload the tiny model's partitions are smaller than DeepSpeed's smallest asynchronous I/O
        # (aio block_size, 1 MiB): it keeps them in host RAM rather than swap them, so host RAM holds here what
        # a large model's ranks would swap.
        host = planned.host + (planned.nvme if "nvme" in config else 0)
        assert measured["host"] == pytest.approx(host, rel=EXACT_RTOL, abs=64)
        if config in BUFFERS_NOT_MEASURED:
            assert measured["buffers"] == 0, f"{config} now measures its buffers: compare them, update docs/planner.md"
        else:
            assert measured["buffers"] == pytest.approx(measurable_buffers(strategy, shape, 2), rel=BUFFER_RTOL)


def measurable_buffers(strategy: Strategy, shape, world: int) -> float:
    """The planned buffers that exist at the probe's moments. ZeRO-1/2: the reduce buckets, all of buffers().
    ZeRO-3: its reduce bucket only. After each backward it has released every gathered parameter, and it gathers
    the persistent ones for good only after the first step (stage3.py `_post_step`), so the rest of buffers()
    (gathered layers, persistent parameters) is planned from DeepSpeed's code, not measured here."""
    if strategy.shard < 3:
        return buffers(strategy, shape, shape.params, world, "fp32")
    bucket = deepspeed_sizes(strategy, shape)["reduce_bucket"] * (2 if strategy.mixed_precision != "no" else 4)
    # The sequence split's first step runs sp x the micro-batches: by the third, DeepSpeed has traced the module
    # order and keeps the persistent parameters gathered (partitioned_param_coordinator.py releases only those
    # without ds_persist once the trace is complete).
    persistent = strategy.compute_bytes * persistent_elements(strategy, shape)
    return bucket + (persistent if strategy.sequence_split > 1 else 0)


@pytest.mark.parametrize("config", THREE_RANK_CONFIGS)
def test_bf16_on_3_ranks_holds_the_planned_states(config, three_rank_run, tiny_assets):
    """ZeRO-1, -2 and -3 in bf16 on 3 ranks (conftest.three_rank_run), where each stage's formulas differ: the
    16-bit weights (partitioned by ZeRO-3 only), the fp32 master, m and v partitions, and the gradients: ZeRO-1 at
    its step one group's fp32 partition beside the whole 16-bit gradients of the parameters overlapping the rank's
    partition (more than its full gradients on 3 ranks), ZeRO-2 its fp32 partition, ZeRO-3 its fp32 partition plus
    one optimizer sub-group's fp32 gradient at a time, cut from the model's parameter order as DeepSpeed cuts them
    (TINY_ZERO_SIZES: several sub-groups per rank)."""
    measured = held(three_rank_run(config))
    shape = resolve_model(tiny_assets[0])
    strategy = strategy_as_launched(config, "bf16")
    planned = model_states(strategy, shape.params, THREE_RANKS, shape)
    if strategy.shard == 1:  # the overlapping parameters' gradients bind, not the full 16-bit gradients
        assert planned.gradients > 2 * shape.params
    if strategy.shard >= 3:
        partition = shape.params / THREE_RANKS
        sub_group = largest_sub_group(strategy, shape, shape.params, THREE_RANKS)
        assert strategy.sub_group <= sub_group < partition / 3  # several sub-groups per rank
        assert planned.gradients == pytest.approx(4 * partition + 4 * sub_group)
    assert measured["weights"] == pytest.approx(planned.weights, rel=EXACT_RTOL)
    assert measured["optimizer"] == pytest.approx(planned.optimizer, rel=EXACT_RTOL)
    assert measured["gradients"] == pytest.approx(planned.gradients, rel=GRADIENT_RTOL)
    assert measured["host"] == planned.host == 0
    if config not in BUFFERS_NOT_MEASURED:
        assert measured["buffers"] == pytest.approx(measurable_buffers(strategy, shape, THREE_RANKS),
                                                    rel=BUFFER_RTOL)









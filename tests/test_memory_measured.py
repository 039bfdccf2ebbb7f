"""The planner's model states against what each rank really holds. Every shipped config's 2-process reference
run (fp32) measures its weights, gradients and optimizer states on the live objects at the first step
(shardtune.memory) and logs the largest rank's bytes; the planner predicts them from the config alone."""

from __future__ import annotations

import pytest

from shardtune.flops import resolve_model
from shardtune.plan import buffers, model_states, read_accelerate_config
from tests.conftest import CONFIGS, read_metrics
from tests.test_strategies import CONFIG_NAMES

# The README's figures. Weights and optimizer states: exact up to Adam's step counters (4 bytes per tensor) and,
# under ZeRO, how each parameter group's flat buffer splits over the ranks (-0.33% off the even share here).
EXACT_RTOL = 4e-3
# Gradients: exact but for a few alignment elements of ZeRO's partitions (+0.03% here).
GRADIENT_RTOL = 1e-3
# Offload configs hold everything in host RAM, which on a CPU machine is the "device" too: totals are compared.
OFFLOAD_RTOL = 0.05
# DeepSpeed's buffers (reduce bucket allocated whole, ZeRO-3 layers still gathered): ZeRO-1 exact, ZeRO-3 +-0.04%.
# Under ZeRO-2 the probe finds no bucket at the first step (0 bytes): there the buffer is planned, not measured.
BUFFER_RTOL = 1e-3
BUFFERS_NOT_MEASURED = {"ds_zero2"}


def held(output_dir) -> dict[str, int]:
    (row,) = [row for row in read_metrics(output_dir) if "held_weights_bytes" in row]
    return {key: row[f"held_{key}_bytes"] for key in ("weights", "gradients", "optimizer", "buffers")}


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_model_states_equal_the_bytes_each_rank_holds(config, reference_run, tiny_assets):
    measured = held(reference_run(config))
    strategy = read_accelerate_config(str(CONFIGS / f"{config}.yaml"), mixed_precision="no")
    shape = resolve_model(tiny_assets[0])
    params = shape.params
    planned = model_states(strategy, params, world=2)
    offloaded = planned.host + planned.nvme
    if not offloaded:
        assert measured["weights"] == pytest.approx(planned.weights, rel=EXACT_RTOL)
        assert measured["optimizer"] == pytest.approx(planned.optimizer, rel=EXACT_RTOL)
        assert measured["gradients"] == pytest.approx(planned.gradients, rel=GRADIENT_RTOL)
    elif "nvme" not in config:  # on a CPU machine the host and the "GPU" are the same memory: compare totals
        total = measured["weights"] + measured["gradients"] + measured["optimizer"]
        assert total == pytest.approx(planned.weights + planned.gradients + planned.optimizer + offloaded,
                                      rel=OFFLOAD_RTOL)
    else:  # NVMe: Adam's states and the fp32 master live in swap files; the gradient partitions in host RAM
        assert measured["gradients"] == pytest.approx(planned.host, rel=GRADIENT_RTOL)
        # DeepSpeed swapped under --offload_nvme_path (it deletes the files at exit, the folders stay).
        swap_root = reference_run(config).parent / "nvme" / "zero_stage_3"
        assert {path.name for path in swap_root.iterdir()} == {"optimizer", "float32params"}
    if strategy.kind == "deepspeed":  # reduce buckets (allocated whole) and ZeRO-3 layers still gathered
        if config in BUFFERS_NOT_MEASURED:
            assert measured["buffers"] == 0, f"{config} now measures its buffers: compare them, update the README"
        else:
            assert measured["buffers"] == pytest.approx(buffers(strategy, shape, params, 2, "fp32"), rel=BUFFER_RTOL)

"""Every shipped accelerate config trains the tiny recipe with 2 real processes on CPU, and all of them follow
the same loss curve as one process: in fp32 to a tight tolerance, in bf16 to a looser one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CONFIGS, run_recipe, train_losses

CONFIG_NAMES = sorted(path.stem for path in CONFIGS.glob("*.yaml"))
STEPS = ("--max_steps", "6")
# fp32: the ranks only change the order of float sums (all-reduce vs reduce-scatter, a sharded Adam step),
# which moves the loss by about 1e-7 per step; 1e-5 leaves room for six steps of drift, and nothing more.
FP32_RTOL = 1e-5
# bf16: each strategy casts at different places (autocast for DDP, FSDP's MixedPrecisionPolicy, DeepSpeed's
# bf16 module with fp32 master weights); bf16 has an 8-bit mantissa (~0.4% per rounding), so losses agree to 2%.
BF16_RTOL = 2e-2


def nvme_args(config: str, tmp_path) -> tuple[str, ...]:
    if "nvme" not in config:
        return ()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("NVMe offload needs libaio for DeepSpeed's async_io op: apt-get install libaio-dev")
    swap = tmp_path / "nvme"
    swap.mkdir()
    return ("--offload_param_nvme_path", str(swap), "--offload_optimizer_nvme_path", str(swap))


@pytest.fixture(scope="module")
def single_process_fp32(tiny_assets, tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    output_dir = tmp_path_factory.mktemp("single") / "out"
    run_recipe(output_dir, tiny_assets, *STEPS, "--mixed_precision", "no")
    return train_losses(output_dir), load_file(output_dir / "model.safetensors")


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_every_config_trains_and_matches_one_process_in_fp32(config, single_process_fp32, tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    run_recipe(output_dir, tiny_assets, *STEPS, "--mixed_precision", "no", config=config, processes=2,
               launch_args=nvme_args(config, tmp_path))
    reference_losses, reference_weights = single_process_fp32
    losses = train_losses(output_dir)
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.1, f"{config}: loss did not fall: {losses}"
    assert losses == pytest.approx(reference_losses, rel=FP32_RTOL)
    # The saved model is the full model, gathered from the shards, equal to the one-process result.
    weights = load_file(output_dir / "model.safetensors")
    assert weights.keys() == reference_weights.keys()
    for key, tensor in reference_weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=1e-4, atol=1e-5, msg=f"{config}: {key}")


def test_bf16_strategies_agree(tiny_assets, tmp_path):
    curves = {}
    for config in (None, "ddp", "fsdp_full_shard", "ds_zero3"):
        output_dir = tmp_path / (config or "single")
        run_recipe(output_dir, tiny_assets, *STEPS, "--mixed_precision", "bf16", config=config, processes=2)
        curves[config or "single"] = train_losses(output_dir)
    reference = curves.pop("single")
    for config, losses in curves.items():
        assert losses == pytest.approx(reference, rel=BF16_RTOL), config
    # bf16 must really be on: its curve differs from fp32 in the low digits.
    fp32_dir = tmp_path / "fp32"
    run_recipe(fp32_dir, tiny_assets, *STEPS, "--mixed_precision", "no")
    assert train_losses(fp32_dir) != pytest.approx(reference, rel=1e-6)

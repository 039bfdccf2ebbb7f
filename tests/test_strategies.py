"""Every shipped accelerate config trains the tiny recipe with 2 real processes on CPU, and all of them follow
the same loss curve as one process: in fp32 to a tight tolerance, in bf16 to a looser one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CONFIGS, REFERENCE_ARGS, run_recipe, train_losses

CONFIG_NAMES = sorted(path.stem for path in CONFIGS.glob("*.yaml"))
# fp32: the ranks only change the order of float sums (all-reduce vs reduce-scatter, a sharded Adam step),
# which moves the loss by about 1e-7 per step; 1e-5 leaves room for eight steps of drift, and nothing more.
FP32_RTOL = 1e-5
# bf16: each strategy casts at different places (autocast for DDP, FSDP's MixedPrecisionPolicy, DeepSpeed's
# bf16 module with fp32 master weights); bf16 has an 8-bit mantissa (~0.4% per rounding), so losses agree to 2%.
BF16_RTOL = 2e-2


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_every_config_trains_and_matches_one_process_in_fp32(config, reference_run):
    output_dir = reference_run(config)
    reference_losses = train_losses(reference_run(None))
    reference_weights = load_file(reference_run(None) / "model.safetensors")
    losses = train_losses(output_dir)
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.1, f"{config}: loss did not fall: {losses}"
    assert losses == pytest.approx(reference_losses, rel=FP32_RTOL)
    # The saved model is the full model, gathered from the shards, equal to the one-process result.
    weights = load_file(output_dir / "model.safetensors")
    assert weights.keys() == reference_weights.keys()
    for key, tensor in reference_weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=1e-4, atol=1e-5, msg=f"{config}: {key}")


def test_bf16_strategies_agree(reference_run, tiny_assets, tmp_path):
    """One run per bf16 mechanism: autocast (one process; DDP casts the same way), FSDP2's MixedPrecisionPolicy
    (FULL_SHARD; SHARD_GRAD_OP casts the same way) and DeepSpeed's bf16 engine (ZeRO-3; ZeRO-1/2 use the same
    engine)."""
    curves = {}
    for config in (None, "fsdp_full_shard", "ds_zero3"):
        output_dir = tmp_path / (config or "single")
        run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--mixed_precision", "bf16", "--save_steps", "0",
                   config=config, processes=2)
        curves[config or "single"] = train_losses(output_dir)
    reference = curves.pop("single")
    for config, losses in curves.items():
        assert losses == pytest.approx(reference, rel=BF16_RTOL), config
    # bf16 must really be on: its curve differs from fp32 in the low digits.
    assert train_losses(reference_run(None)) != pytest.approx(reference, rel=1e-6)
    print("bf16 max relative deviation from one process:",
          {config: max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))
           for config, losses in curves.items()})

"""Launched by tests/launch/test_float8.py under `accelerate launch` with the tiny recipe's flags: the trainer's own
loop, with --mixed_precision fp8 when SHARDTUNE_PROBE_FLOAT8=1. The recipe is checked as given (bf16: fp8 is refused
off sm89+, shardtune.levers.float8.check_fp8), then trained as fp8 with torchao's emulated float8 matmuls (the casts to
float8 and their scales as on a GPU, the products in high precision): everything else is the GPU path, the
conversion before sharding, the float8 all-gather after rank-0 loading, the scales precomputed after each step.
The main process prints one JSON line: per rank, the float8 linears, how many of their shards carry torchao's
all-gather wrapper, the sum and count of the precomputed scales, the model's trainable sharded parameters the
optimizer does not step, and the float8 linear calls whose token count is not a multiple of 16 (the inner dimension
of their weight-gradient matmul, which torch._scaled_mm refuses on a GPU and the emulation does not check)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from shardtune.cli import checked_launch, startup_heap_frozen

with startup_heap_frozen():  # the imports as a recipe's launch makes them (shardtune.cli.main)
    import torch

    from shardtune import trainer
    from shardtune.checkpoint.preemption import StopRequest
    from shardtune.checkpoint.run_settings import resume_point
    from shardtune.config import FP8_DIM_MULTIPLE, Recipe
    from shardtune.levers.float8 import convert_linears
    from shardtune.parallel.distributed import make_accelerator, shut_down

FLOAT8 = os.environ.get("SHARDTUNE_PROBE_FLOAT8") == "1"


def count_odd_token_calls(model: torch.nn.Module) -> list[int]:
    """A one-item counter of the float8 linear calls whose tokens are not a multiple of FP8_DIM_MULTIPLE."""
    from torchao.float8.float8_linear import Float8Linear

    odd = [0]

    def check(module: torch.nn.Module, args: tuple) -> None:
        odd[0] += args[0].numel() // module.in_features % FP8_DIM_MULTIPLE != 0

    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.register_forward_pre_hook(check)
    return odd


def float8_figures(model: torch.nn.Module, optimizer: torch.optim.Optimizer, odd_calls: int) -> list[float]:
    """(float8 linears, shards wrapped for float8 all-gather, sum and count of their precomputed scales, trainable
    sharded parameters of the model that the optimizer does not step, float8 calls of an odd token count) on this
    rank."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    linears = [module for module in model.modules() if isinstance(module, Float8Linear)]
    shards = [module.weight._local_tensor for module in linears]
    wrapped = [shard for shard in shards if isinstance(shard, WeightWithDynamicFloat8CastTensor)]
    scales = [float(shard._precomputed_scale) for shard in wrapped if shard._precomputed_scale is not None]
    from torch.distributed.tensor import DTensor

    # Sharded ones: after the final eval's forward FSDP2 leaves the root's own unit (norm, lm_head) unsharded.
    stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
    unstepped = [param for param in model.parameters()
                 if param.requires_grad and isinstance(param, DTensor) and id(param) not in stepped]
    return [float(len(linears)), float(len(wrapped)), float(sum(scales)), float(len(scales)), float(len(unstepped)),
            float(odd_calls)]


def main() -> None:
    recipe, launch, batching = checked_launch(Recipe(name="tiny", max_seq_length=64), None)
    if FLOAT8:
        recipe = dataclasses.replace(recipe, mixed_precision="fp8")
        trainer.convert_linears = functools.partial(convert_linears, emulate=True)
    accelerator = make_accelerator(recipe, batching, launch, None)
    built = {}
    build = trainer.build

    def keep(*args):
        built["run"] = build(*args)
        built["odd"] = count_odd_token_calls(built["run"].model) if FLOAT8 else [0]
        return built["run"]

    trainer.build = keep
    code = trainer.train_loop(accelerator, recipe, batching, launch, resume_point(recipe, launch, batching),
                              StopRequest())
    if FLOAT8:
        local = torch.tensor(float8_figures(accelerator.unwrap_model(built["run"].model),
                                               built["run"].optimizer, built["odd"][0]), dtype=torch.float64)
        per_rank = accelerator.gather(local.to(accelerator.device)).view(-1, len(local)).tolist()
        if accelerator.is_main_process:
            print("probe:", json.dumps({"per_rank": per_rank}), flush=True)
    shut_down(accelerator)
    assert code == 0


if __name__ == "__main__":
    main()

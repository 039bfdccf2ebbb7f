"""--mixed_precision fp8: torchao's float8 training (tensorwise dynamic scaling) of the decoder layers' linears, with
FSDP2's float8 all-gather; what it needs from the machine and the launch.

Applied by shardtune itself, not by accelerate's AO backend (Accelerator(mixed_precision="fp8")): accelerate converts
the linears inside `prepare`, and the trainer has sharded the model before that (fsdp2_prepare_model, so that the
optimizer is built on the shards): a conversion after `fully_shard` would swap modules whose parameters FSDP2 and the
optimizer already hold. accelerate also refuses its AO backend with FSDP2's RAM-efficient loading, which every
shipped FSDP config uses. So the linears are converted here, before sharding, and accelerate runs in bf16: every
other tensor (attention, norms, the embedding, lm_head, the loss) computes in bf16 as under --mixed_precision bf16.

Which linears convert: those of the decoder layers whose two dimensions are multiples of 16 (torch._scaled_mm's
constraint; every Llama-class projection is), as torchtitan's float8 converter does; never lm_head, whose output
feeds the loss directly (torchtitan and accelerate both keep it in high precision). The embedding is no linear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtune.config import FP8_DIM_MULTIPLE, FP8_MIN_CAPABILITY, ConfigError, Recipe

if TYPE_CHECKING:  # torch and torchao load with the model, not with the start-up checks (shardtune.checks.startup)
    import torch

KEPT_HIGH_PRECISION = ("lm_head",)  # module names never converted


def converts(module: torch.nn.Module, name: str) -> bool:
    """Whether the linear at `name` trains in float8: a Linear, not in KEPT_HIGH_PRECISION,
    both dimensions multiples of FP8_DIM_MULTIPLE."""
    import torch

    if not isinstance(module, torch.nn.Linear) or name.split(".")[-1] in KEPT_HIGH_PRECISION:
        return False
    return module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0


def float8_config(all_gather: bool, emulate: bool = False):
    """torchao's tensorwise recipe (its default, the fastest; the one float8 all-gather supports), gathering the
    float8 weights under FSDP2 when `all_gather`. `emulate`: matmuls in high precision (tests on CPU)."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=emulate)


def convert_linears(model: torch.nn.Module, all_gather: bool, emulate: bool = False) -> list[str]:
    """Swap the linears `converts` picks for torchao's Float8Linear, in place, before FSDP2 shards the model (its
    float8 all-gather needs the weights wrapped first); the names converted."""
    from torchao.float8 import convert_to_float8_training

    picked = [name for name, module in model.named_modules() if converts(module, name)]
    convert_to_float8_training(model, module_filter_fn=converts, config=float8_config(all_gather, emulate))
    return picked


def precompute_scales_after_step(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """With float8 all-gather: after each optimizer step, every float8 weight's scale from one all-reduce of the
    weights' amaxes (torchao's precompute_float8_dynamic_scale_for_fsdp, where torchtitan's trainer calls it), instead
    of one all-reduce per weight at its next gather. A hook on the optimizer itself: it runs only on the steps that
    update."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def check_fp8(recipe: Recipe, capability: tuple[int, int] | None, launch_kind: str,
              offloads_params: bool = False) -> None:
    """What --mixed_precision fp8 needs, in the order a user meets it. `capability`: the GPU's compute capability,
    None without a GPU (or in CPU mode); `launch_kind`: "ddp", "fsdp" or "deepspeed" (LaunchDescription.kind);
    `offloads_params`: FSDP's CPU offload (fsdp_full_shard_cpu_offload.yaml)."""
    if recipe.mixed_precision != "fp8":
        return
    if capability is None:
        raise ConfigError("--mixed_precision fp8 runs float8 matmuls on CUDA GPUs of compute capability 8.9 or more "
                          "(H100, H200, L4, L40S): on this machine use --mixed_precision bf16.")
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise ConfigError(f"--mixed_precision fp8 needs float8 tensor cores (compute capability 8.9 or more: H100, "
                          f"H200, L4, L40S); this GPU's is {capability[0]}.{capability[1]}: use --mixed_precision "
                          "bf16.")
    if launch_kind == "deepspeed":
        raise ConfigError("--mixed_precision fp8 trains under FSDP2 (float8 all-gather) and DDP only: DeepSpeed "
                          "gathers its own flat bf16 partitions, and float8 is untested under its engine: launch with "
                          "an FSDP or DDP config, or use --mixed_precision bf16.")
    if offloads_params:
        raise ConfigError("--mixed_precision fp8 casts each weight shard to float8 and all-reduces its amax where the "
                          "shard lives, and FSDP's CPU offload keeps the shards in host RAM, where the GPUs' "
                          "collectives cannot reach them (untested): launch with fsdp_full_shard.yaml, or use "
                          "--mixed_precision bf16 with the offload.")
    if recipe.use_peft:
        raise ConfigError("--mixed_precision fp8 speeds up the matmuls of full fine-tuning; LoRA's frozen base would "
                          "still compute each weight gradient in float8 and discard it: use --mixed_precision bf16 "
                          "with --use_peft true.")


def unfused_fp8_warning(recipe: Recipe) -> str | None:
    """The start-up line of an fp8 run that does not compile: torchao's dynamic float8 casts (an amax reduction, a
    scale, a cast per operand of each matmul) are fused into the matmuls' neighbours only by torch.compile; eager,
    each is a kernel of its own over the whole tensor, slower than the bf16 matmul it replaces (pytorch/ao#685: a
    feed-forward layer 1.1x to 3.4x slower than 16-bit, using up to twice its memory; compiled, up to 1.6x faster)."""
    if recipe.mixed_precision != "fp8" or recipe.torch_compile:
        return None
    return ("shardtune: warning: --mixed_precision fp8 without --torch_compile true runs torchao's float8 casts "
            "unfused: expect each layer 1.1-3.4x slower than --mixed_precision bf16, with up to 2x the activation "
            "memory (pytorch/ao#685); add --torch_compile true.")


def rewrap_loaded_shards(model: torch.nn.Module) -> int:
    """After accelerate's FSDP2 preparation: wrap again, for float8 all-gather, the weight shards that RAM-efficient
    loading replaced with plain tensors; the number wrapped. accelerate's fsdp2_load_full_state_dict broadcasts
    rank 0's weights into plain buffers on the other ranks, so only rank 0's shards keep torchao's
    WeightWithDynamicFloat8CastTensor, and its ranks would then all-gather float8 bytes against the others' bf16
    (measured on 2 ranks: a hang at the first forward; accelerate refuses its own AO backend with this loading).
    Each FSDP2 parameter's sharded local tensor and its flat all-gather input get the wrapper, as rank 0's have
    them; FSDP2's lazy initialisation then re-reads both (FSDPParam.reset_sharded_param)."""
    from torch.distributed.fsdp import FSDPModule
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from shardtune.memory import fsdp_param_groups  # imports torch: not at the checks' import

    wrapped = 0
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        for group in fsdp_param_groups(unit):
            for param in group.fsdp_params:
                linear = param._module_info.module
                if not isinstance(linear, Float8Linear) or not linear.config.enable_fsdp_float8_all_gather \
                        or isinstance(param.sharded_param._local_tensor, WeightWithDynamicFloat8CastTensor):
                    continue
                dtype = linear.config.cast_config_weight.target_dtype
                param.sharded_param._local_tensor = WeightWithDynamicFloat8CastTensor(
                    param.sharded_param._local_tensor, linear.linear_mm_config, dtype)
                param._sharded_param_data = WeightWithDynamicFloat8CastTensor(
                    param._sharded_param_data, linear.linear_mm_config, dtype)
                wrapped += 1
    return wrapped

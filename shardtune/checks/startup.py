"""The recipe's checks that need no model and no data read: values, choices, the packages they need, the output
dir, the batch over the launched ranks. Each raises ConfigError; check_recipe runs them all, collecting each one."""

from __future__ import annotations

from collections.abc import Callable

from shardtune.checks.nvme import AsyncIOReadiness, check_async_io, check_nvme_path, offloads_to_nvme
from shardtune.checks.outputs import check_async_save, check_checkpoints, check_exports, check_output_dir
from shardtune.checks.values import (
    check_activation_offloading,
    check_attention,
    check_checkpointing_mode,
    check_choices,
    check_compile_under,
    check_device,
    check_inputs_named,
    check_lora,
    check_loss_scaler,
    check_numbers,
    check_optimizer,
    check_packing_strategy,
    check_pad_to_multiple_of,
    check_quantization,
    check_torch_compile,
    check_tracking,
)
from shardtune.config import (
    FP8_MIN_CAPABILITY,
    BatchSizes,
    ConfigError,
    Problems,
    Recipe,
    below_lowest,
)
from shardtune.data.sources import (
    check_chat_template,
    check_dataset_num_proc,
    check_dataset_weights,
)
from shardtune.launch import LaunchDescription
from shardtune.levers.float8 import check_fp8
from shardtune.levers.liger import check_liger_device, check_liger_kernel
from shardtune.methods.checks import check_dpo_flags, check_dpo_launch, check_dpo_values, check_reference_model
from shardtune.parallel.context import check_context_parallel
from shardtune.parallel.sequence import check_sequence_split
from shardtune.parallel.tensor import check_tensor_parallel
from shardtune.plan.hardware import Hardware, HardwareError, parse_hardware


def batch_sizes(recipe: Recipe, world_size: int, tp_size: int = 1, cp_size: int = 1) -> BatchSizes:
    """The micro-batch, accumulation and data-parallel ranks (the processes / (tp_size x cp_size)) that make
    --global_batch_size, or ConfigError when they cannot."""
    micro, gas, total = recipe.per_device_train_batch_size, recipe.gradient_accumulation_steps, recipe.global_batch_size
    too_small = below_lowest([("--per_device_train_batch_size", micro), ("--gradient_accumulation_steps", gas)])
    if too_small:
        raise ConfigError(too_small[0])
    ranks, group = world_size // (tp_size * cp_size), " x ".join(f"{name} {size}" for name, size in (
        ("tp_size", tp_size), ("cp_size", cp_size)) if size > 1)
    per_step, what = micro * ranks, f"data ranks (processes / {group})" if group else "processes"
    if total is None:
        return BatchSizes(micro, gas or 1, world_size, tp_size, cp_size)
    if total % per_step:
        raise ConfigError(f"--global_batch_size {total} is not divisible by per_device_train_batch_size x {what} = "
                          f"{micro} x {ranks} = {per_step}. Pick a global batch that is a multiple of {per_step}, "
                          f"or {sizes_keeping(total, micro, ranks, tp_size * cp_size)}.")
    if gas is not None and gas * per_step != total:
        raise ConfigError(f"--gradient_accumulation_steps {gas} disagrees with --global_batch_size {total}: "
                          f"{micro} x {gas} x {ranks} {what} = {gas * per_step}. Give only one of the two.")
    return BatchSizes(micro, total // per_step, world_size, tp_size, cp_size)


def sizes_keeping(total: int, micro: int, ranks: int, group: int) -> str:
    """The micro-batches on these ranks, and the process counts at this micro-batch, that make `total` (the global
    batch a resumed run must keep)."""
    def listed(sizes: list[int]) -> str:
        return ", ".join(map(str, sizes[:-1])) + f" or {sizes[-1]}" if len(sizes) > 1 else str(sizes[0])

    micros = [size for size in range(1, total // ranks + 1) if total % (size * ranks) == 0]
    processes = [size * group for size in range(1, total // micro + 1) if total % (size * micro) == 0]
    ways = ([f"--per_device_train_batch_size {listed(micros)} on these {ranks} data ranks"] if micros else []) + \
        ([f"{listed(processes)} processes at --per_device_train_batch_size {micro}"] if processes else [])
    return f"to keep {total} (a resumed run's): {', or '.join(ways)}" if ways else \
        "change --per_device_train_batch_size"


# Compute capability of the GPUs --hardware can name (hardware.PEAK_BF16_FLOPS), which a dry run plans fp8 on; a
# GPU left unnamed (8x80gb) is taken to have float8 tensor cores, which its launch checks.
GPU_CAPABILITY = {"a100": (8, 0), "h100": (9, 0), "h100-pcie": (9, 0), "h200": (9, 0), "b200": (10, 0)}


def planned_capability(hardware: Hardware) -> tuple[int, int]:
    """The compute capability of the planned GPUs."""
    return GPU_CAPABILITY.get(hardware.gpu or "", FP8_MIN_CAPABILITY)


def check_hardware_launch(recipe: Recipe, launch: LaunchDescription) -> None:
    """--hardware at launch plans the run against that hardware's GPU memory in place of this machine's: it must be
    the launch's own GPUs, or the plan would be another run's (a dry run plans --hardware for itself)."""
    if not recipe.hardware:
        return
    try:
        hardware = parse_hardware(recipe.hardware)
    except HardwareError as error:
        raise ConfigError(str(error)) from None
    if recipe.use_cpu:
        raise ConfigError(f"--hardware {recipe.hardware} plans GPUs, and this run trains on CPU (--use_cpu true): drop "
                          f"it, or plan that hardware with --dry_run --hardware {recipe.hardware}.")
    if (hardware.nodes, hardware.gpus_per_node) != (launch.num_machines, launch.local_world_size):
        raise ConfigError(f"--hardware {recipe.hardware} plans {hardware.nodes} node(s) of {hardware.gpus_per_node} "
                          f"GPUs, and this launch runs {launch.num_machines} of {launch.local_world_size} processes: "
                          f"give the launch's own GPUs (e.g. {launch.num_machines}x{launch.local_world_size}x80gb), or "
                          f"plan that hardware with --dry_run --hardware {recipe.hardware}.")


# Checks that need the recipe alone: no model, no data read, no launch environment. Each raises ConfigError (with
# one message or several); all of them run and every failure is reported together. A new check goes here.
RECIPE_CHECKS: tuple[Callable[[Recipe], None], ...] = (
    check_inputs_named,
    check_dataset_weights,
    check_dataset_num_proc,
    check_chat_template,
    check_choices,
    check_packing_strategy,
    check_pad_to_multiple_of,
    check_liger_kernel,
    check_numbers,
    check_dpo_values,
    check_tracking,
    check_checkpoints,
    check_exports,
    check_output_dir,
)
# Checks of settings that act only beside another: they also take the fields given on the command line, since a
# flag given at its default value (--lora_alpha 32 without --use_peft) is given all the same.
GIVEN_CHECKS: tuple[Callable[[Recipe, frozenset[str]], None], ...] = (
    check_lora,
    check_checkpointing_mode,
    check_torch_compile,
    check_dpo_flags,
)
# What a --dry_run leaves out, and why: it judges the launch it plans on --hardware, from wherever it runs; each of
# these judges the machine the run starts on, its disks or the run's output dir. Every other check runs in both.
NOT_IN_DRY_RUN: dict[Callable[..., None], str] = {
    check_inputs_named: "the dataset's files are on the machine that trains (a dry run plans without --dataset)",
    check_checkpoints: "the output dir's checkpoints are the training machine's",
    check_output_dir: "the output dir is the training machine's",
    check_device: "this machine's GPU: a dry run plans --hardware's",
    check_async_io: "DeepSpeed's async_io op is built on the machine that trains",
    check_hardware_launch: "it compares --hardware with the launch's processes, and a dry run plans --hardware",
    check_reference_model: "the reference model's files are the training machine's, as the policy's are",
    # and, in check_recipe and check_on_device, the NVMe directory's existence and the packages a run loads
}
def check_recipe(recipe: Recipe, problems: Problems, launch: LaunchDescription | None,
                 given: frozenset[str] = frozenset(), planned: bool = False) -> BatchSizes | None:
    """Run every check that needs the command line and the launch alone, recording failures in `problems`.
    `launch`: None when the launch environment failed its own checks (the checks that depend on it are then
    skipped). `given`: the fields on the command line (shardtune.flags.given_fields). `planned`: a --dry_run's
    launch, which leaves out NOT_IN_DRY_RUN and the NVMe directory's existence. Returns the batch sizes, or None if
    they could not be made."""
    for check in RECIPE_CHECKS:
        if not (planned and check in NOT_IN_DRY_RUN):
            problems.check(check, recipe)
    for given_check in GIVEN_CHECKS:
        problems.check(given_check, recipe, given)
    if launch is None:
        return None
    problems.check(check_nvme_path, recipe, launch.nvme_offloaded, not planned)
    problems.check(check_tensor_parallel, recipe, launch.tp_size, given)
    return problems.check(batch_sizes, recipe, launch.world_size, launch.tp_size, launch.cp_size)


def check_on_device(recipe: Recipe, problems: Problems, launch: LaunchDescription, on_gpu: bool,
                    capability: tuple[int, int] | None, loads: bool = True) -> None:
    """The checks of the recipe on its devices under the launch: the attention kernel, 4-bit quantization,
    activation offloading, Liger, fp16's loss scaler, the optimizer, compilation, async saves, fp8's float8 tensor
    cores and the sequence split (DPO's too). A launch passes this machine's (`on_gpu`: a CUDA GPU in use;
    `capability`: its compute capability where fp8 needs it); a --dry_run the planned GPUs', with `loads` false."""
    problems.check(check_attention, recipe, on_gpu, loads)
    problems.check(check_quantization, recipe, on_gpu, loads)
    problems.check(check_activation_offloading, recipe, on_gpu, launch.deepspeed_offloads)
    problems.check(check_liger_device, recipe, on_gpu)
    problems.check(check_loss_scaler, recipe, on_gpu, launch.uses_deepspeed)
    problems.check(check_optimizer, recipe, on_gpu, launch.kind, launch.world_size, loads, launch.hybrid_shard)
    problems.check(check_compile_under, recipe, launch)
    problems.check(check_async_save, recipe, launch)
    problems.check(check_fp8, recipe, capability, launch.kind, launch.fsdp_offload_params)
    problems.check(check_sequence_split, recipe, launch.sp_size, launch.deepspeed_settings)
    problems.check(check_context_parallel, recipe, launch.cp_size, on_gpu)
    problems.check(check_dpo_launch, recipe, launch.sp_size)


def check_machine(recipe: Recipe, problems: Problems, has_gpu: bool, launch: LaunchDescription) -> None:
    """The checks that depend on this machine: a GPU, or CPU mode asked for; DPO's reference model; check_on_device
    with this machine's GPU; NVMe offload's async_io op. `has_gpu`: CUDA is available."""
    import torch  # imported by now (cli.checked_launch)

    problems.check(check_device, recipe, has_gpu, launch.local_world_size, torch.cuda.device_count() if has_gpu else 0)
    problems.check(check_reference_model, recipe)
    on_gpu = has_gpu and not recipe.use_cpu
    check_on_device(recipe, problems, launch, on_gpu, gpu_capability(recipe, on_gpu))
    from shardtune.parallel.distributed import check_deepspeed_fp16  # torch is imported by now (cli.checked_launch)
    problems.check(check_deepspeed_fp16, recipe, launch)
    if offloads_to_nvme(launch):
        problems.check(check_async_io, AsyncIOReadiness.of_this_machine(has_gpu))


def gpu_capability(recipe: Recipe, on_gpu: bool) -> tuple[int, int] | None:
    """This GPU's compute capability where a check needs it (--mixed_precision fp8), else None."""
    if not (on_gpu and recipe.mixed_precision == "fp8"):
        return None
    import torch

    return torch.cuda.get_device_capability()


def validate(recipe: Recipe, launch: LaunchDescription, has_gpu: bool) -> BatchSizes:
    """Every check that needs no model and no data loaded. `has_gpu`: CUDA is available. Raises one ConfigError
    with every failure."""
    problems = Problems()
    batching = check_recipe(recipe, problems, launch)
    check_machine(recipe, problems, has_gpu, launch)
    problems.raise_any()
    assert batching is not None  # no problems: batch_sizes returned
    return batching

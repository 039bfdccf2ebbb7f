"""The Accelerator for the launch environment, on GPUs or, for tests and the demo, on CPUs over gloo."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
)
from torch.distributed.fsdp import CPUOffloadPolicy

from shardtune.config import BatchPlan, ConfigError, Recipe, launch_env


def make_accelerator(recipe: Recipe, plan: BatchPlan, log_with: str | None) -> Accelerator:
    world_size, uses_deepspeed, uses_fsdp = launch_env()
    on_cpu = not torch.cuda.is_available()
    if uses_deepspeed and recipe.offload_nvme_path:  # read by accelerate's DeepSpeed plugin; the launcher sets none
        for kind in ("OPTIMIZER", "PARAM"):
            os.environ[f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind}_NVME_PATH"] = recipe.offload_nvme_path
    accelerator = Accelerator(
        # Without CUDA, accelerate would start N unconnected single processes for DDP/FSDP configs: ask for
        # MULTI_CPU over gloo. DeepSpeed ignores `cpu=True`; it gets gloo through the process-group kwargs.
        cpu=on_cpu and not uses_deepspeed,
        mixed_precision=recipe.mixed_precision,  # the recipe wins over the config file, DeepSpeed included
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=plan.accumulation, sync_with_dataloader=False  # the trainer ends every cycle itself
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.seed),
        step_scheduler_with_optimizer=False,  # the scheduler counts optimizer steps, stepped by the trainer
        log_with=log_with,
        project_dir=recipe.resolved_output_dir,
        kwargs_handlers=[InitProcessGroupKwargs(
            backend="gloo" if on_cpu and uses_deepspeed else None,
            timeout=timedelta(minutes=recipe.startup_timeout_minutes),  # lowered once the model is in place
        )],
    )
    if on_cpu and uses_fsdp:
        enable_fsdp_on_cpu(accelerator)
    if accelerator.num_processes != world_size:
        raise ConfigError(
            f"accelerate started {accelerator.num_processes} process(es) in the process group but WORLD_SIZE is "
            f"{world_size}: the ranks would train independently. Check the accelerate config's distributed_type."
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # The recipe owns clipping; DeepSpeed applies it inside its step.
        accelerator.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] = recipe.max_grad_norm
    return accelerator


def enable_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """accelerate enables FSDP only on an accelerator, although FSDP2 runs on CPU over gloo. Switch the state
    to FSDP with the plugin from the launch environment, before `prepare`, so accelerate's own FSDP path runs."""
    state = accelerator.state
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables set by `accelerate launch`
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)  # pinning host memory needs an accelerator
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    # AcceleratorState copies PartialState's shared fields whenever it is instantiated again: set both.
    PartialState._shared_state["distributed_type"] = state.distributed_type = DistributedType.FSDP

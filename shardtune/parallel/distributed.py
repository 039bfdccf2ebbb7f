"""The Accelerator for the launch environment: on GPUs, or on CPUs over gloo when CPU mode is asked for
(`--use_cpu true`, as the tests and the demo do). The CPU-only switches live here and nowhere else."""

from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta
from typing import NoReturn

import torch
from accelerate import Accelerator, ParallelismConfig, PartialState
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from shardtune.config import BatchSizes, ConfigError, Recipe, compute_precision
from shardtune.launch import LaunchDescription
from shardtune.memory import fsdp_param_groups
from shardtune.parallel.pinned_memory import exact_pinned_host_memory
from shardtune.parallel.sequence import ulysses_parallelism

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_deepspeed_fp16(recipe: Recipe, launch: LaunchDescription) -> None:
    """fp16 under DeepSpeed where its accelerator has none: DeepSpeed's engine asks get_accelerator()
    .is_fp16_supported() (on CPU, oneDNN's fp16 kernels: Intel's AVX512-FP16 or AMX-FP16; AMD processors have
    none) and raises "Type fp16 is not supported on your device" only after the model has loaded. The same question,
    before anything loads; deepspeed is imported only for an fp16 DeepSpeed launch, which imports it anyway."""
    from_json = launch.deepspeed_settings.get("mixed_precision")
    if not launch.uses_deepspeed or (from_json or recipe.mixed_precision) != "fp16":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        fix = ('set "fp16": {"enabled": false} (or "auto") in the DeepSpeed JSON' if from_json else
               "use --mixed_precision bf16 or no")
        raise ConfigError(f"fp16 under DeepSpeed needs fp16 support on the device, and DeepSpeed's "
                          f"{accelerator.device_name()} accelerator reports none here (on CPU: oneDNN's fp16 kernels, "
                          f"Intel AVX512-FP16 or AMX-FP16): {fix}.")


def make_accelerator(recipe: Recipe, batching: BatchSizes, launch: LaunchDescription, log_with: str | None
                     ) -> Accelerator:
    world_size, uses_deepspeed, uses_fsdp = launch.world_size, launch.uses_deepspeed, launch.uses_fsdp
    on_cpu = recipe.use_cpu
    precision = compute_precision(recipe.mixed_precision)  # fp8: shardtune.levers.float8 converts the linears itself
    plugin = fsdp_plugin(precision, on_cpu, recipe.bf16_stochastic_round) if uses_fsdp else None
    # A mesh accelerate refuses to build on MULTI_CPU: set once the state is FSDP (enable_fsdp_on_cpu) or, for TP
    # alone, by mesh_on_cpu. Any data-parallel sizes under FSDP2, a replicate size of 1 included (the hybrid config
    # launched on one node, as train.sbatch launches it on the one node a requeue got).
    mesh_on_cpu = on_cpu and (launch.tp_size > 1 or launch.cp_size > 1 or uses_fsdp and launch.dp_shard_size > 0)
    if uses_deepspeed:
        deepspeed_launch_env(recipe, launch)
    if launch.deepspeed_offloads:
        exact_pinned_host_memory()
    accelerator = Accelerator(
        # On CPU, accelerate would start N unconnected single processes for DDP/FSDP configs: ask for
        # MULTI_CPU over gloo. DeepSpeed ignores `cpu=True`; it gets gloo through the process-group kwargs.
        cpu=on_cpu and not uses_deepspeed,
        # The recipe wins over the config file, DeepSpeed included. Stochastically rounded bf16 weights need no cast,
        # and accelerate's FSDP2 preparation would upcast them to an fp32 master under any other value. Never "fp8":
        # accelerate's AO backend would convert the linears again inside `prepare`, after FSDP2 sharded them.
        mixed_precision="no" if recipe.bf16_stochastic_round else precision,
        fsdp_plugin=plugin,
        parallelism_config=parallelism(recipe, launch, mesh_on_cpu),
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            # Under the sequence split each micro-batch runs as sp slices on every rank (shardtune.parallel.sequence)
            num_steps=batching.accumulation * launch.sp_size,
            sync_with_dataloader=False,  # the trainer ends every cycle itself
            # FSDP2 under no_sync keeps every layer's unsharded gradient until the last micro-batch (2 bytes x P
            # per GPU in bf16): reduce-scatter each micro-batch into the sharded fp32 gradient instead, as
            # torchtitan does. DDP keeps no_sync and its saved traffic, as accelerate and the Trainer do, at the
            # cost of a second copy of the gradients beside its buckets while a step accumulates
            # (plan.backward_moments).
            sync_each_batch=uses_fsdp,
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.seed),
        step_scheduler_with_optimizer=False,  # the scheduler counts optimizer steps, stepped by the trainer
        log_with=log_with,
        project_dir=recipe.resolved_output_dir,
        kwargs_handlers=[
            InitProcessGroupKwargs(
                backend="gloo" if on_cpu and uses_deepspeed else None,
                timeout=timedelta(minutes=recipe.startup_timeout_minutes),  # lowered once the model is in place
            ),
            # DDP's gradients as views into its all-reduce buckets: one full gradient copy (4 bytes x P) fewer once a
            # step synchronises.
            DistributedDataParallelKwargs(gradient_as_bucket_view=True),
        ],
    )
    if on_cpu and uses_fsdp:
        enable_fsdp_on_cpu(accelerator, plugin, ParallelismConfig() if mesh_on_cpu else None)
    elif mesh_on_cpu:
        mesh_on_multi_cpu(accelerator, ParallelismConfig())
    if accelerator.num_processes != world_size:
        raise ConfigError(
            f"accelerate started {accelerator.num_processes} process(es) in the process group but WORLD_SIZE is "
            f"{world_size}: the ranks would train independently. Check the accelerate config's distributed_type."
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        configure_deepspeed(accelerator.state.deepspeed_plugin.deepspeed_config, recipe)
    return accelerator


def parallelism(recipe: Recipe, launch: LaunchDescription, mesh_on_cpu: bool) -> ParallelismConfig | None:
    """The ParallelismConfig the Accelerator gets: the sequence split's (Ulysses, under DeepSpeed), or for a mesh on
    CPU (hybrid sharding, tensor parallelism) a config of size 1 (accelerate builds the launch's mesh from the
    PARALLELISM_CONFIG_* variables but refuses it on MULTI_CPU; the mesh is set once the state is FSDP,
    enable_fsdp_on_cpu, or by mesh_on_multi_cpu); None: accelerate reads the launch's own."""
    if launch.sp_size > 1:
        return ulysses_parallelism(recipe, launch.world_size, launch.sp_size)
    if mesh_on_cpu:
        return ParallelismConfig(dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1)
    return None


def fsdp_plugin(mixed_precision: str, on_cpu: bool, pure_bf16: bool = False) -> FullyShardedDataParallelPlugin:
    """The plugin from the FSDP_* variables `accelerate launch` set, with gradients reduced in fp32: bf16
    compute, but the reduce-scatter sums N ranks' gradients into the fp32 master shard, and a bf16 sum loses
    the low bits of every addend (torchtitan reduces in fp32 too). `pure_bf16` (--bf16_stochastic_round): there
    is no fp32 shard to sum into, the sum is rounded to the bf16 gradient shard either way, so it is reduced in
    bf16 and the fp32 copies of the unsharded gradients (a layer's, and the embedding's and lm_head's) are never
    made. The output cast to bf16 keeps eval's logits in
    bf16 (accelerate's autocast wrapper returns them in fp32); it casts every floating output of the root module,
    so the step computes its loss outside the forward (shardtune.step.token_loss)."""
    plugin = FullyShardedDataParallelPlugin()
    if on_cpu and isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)  # pinning host memory needs an accelerator
    half = HALF_DTYPES.get(mixed_precision)
    if half is not None:
        plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=half, reduce_dtype=half if pure_bf16 else torch.float32, output_dtype=half)
    return plugin


def deepspeed_launch_env(recipe: Recipe, launch: LaunchDescription) -> None:
    """What accelerate's DeepSpeed plugin reads from the environment, set before it is built. The JSON file as
    the planner and the checks found it: accelerate opens the YAML's relative deepspeed_config_file from the
    working directory, so a launch from outside the repository would not find accelerate_configs/deepspeed/.
    The NVMe swap directory: the plugin fills a JSON nvme_path of "auto" (and a YAML-only config's) from these
    variables, which `accelerate launch` never sets from a config file."""
    if launch.deepspeed_config_file:
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = launch.deepspeed_config_file
    if recipe.offload_nvme_path:
        for kind in ("OPTIMIZER", "PARAM"):
            os.environ[f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind}_NVME_PATH"] = recipe.offload_nvme_path


def configure_deepspeed(config: dict, recipe: Recipe) -> None:
    """The recipe owns clipping (DeepSpeed applies it inside its step). Under ZeRO-2 and ZeRO-3 gradients
    accumulate over micro-batches in fp32 rather than in the 16-bit model dtype: the partition DeepSpeed reduces
    into becomes fp32 (measured per rank, P parameters over N ranks: ZeRO-2 4P/N instead of (2 + 4)P/N, since the
    fp32 partition is then the one the optimizer reads; ZeRO-3 4P/N instead of 2P/N, beside the one sub-group's
    fp32 gradient its step builds either way). ZeRO-1 stays 16-bit: there DeepSpeed switches to its
    BF16_Optimizer, which keeps a full, unpartitioned fp32 gradient (measured 6P instead of 2P + 4P/N: +32 GB per
    GPU for an 8B model). The shipped JSON files leave data_types out, so this holds for them as for a
    YAML-only config."""
    config["gradient_clipping"] = recipe.max_grad_norm
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if recipe.mixed_precision in HALF_DTYPES and stage >= 2:
        config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"


def reduction_dtypes(model: torch.nn.Module) -> str:
    """How the prepared model reduces and accumulates gradients, read from the live objects: FSDP2's reduce
    dtype per parameter, DeepSpeed's gradient accumulation dtype ("" for DDP, which reduces its fp32 grads)."""
    from torch.distributed.fsdp import FSDPModule

    # Gradients are computed in the policy's param dtype (else the sharded parameters' own) and reduced in its
    # reduce dtype when one is set.
    dtypes = {str(group.mp_policy.reduce_dtype or group.mp_policy.param_dtype or param.sharded_param.dtype
                  ).removeprefix("torch.")
              for module in model.modules() if isinstance(module, FSDPModule)
              for group in fsdp_param_groups(module) for param in group.fsdp_params}
    if dtypes:
        return f"FSDP reduce {'/'.join(sorted(dtypes))}"
    zero = getattr(getattr(model, "optimizer", None), "gradient_accumulation_dtype", None)
    return f"DeepSpeed gradient accumulation {str(zero).removeprefix('torch.')}" if zero is not None else ""


def enable_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin,
                       parallelism: ParallelismConfig | None = None) -> None:
    """accelerate enables FSDP only on an accelerator, although FSDP2 runs on CPU over gloo. Switch the state
    to FSDP with the plugin from the launch environment, before `prepare`, so accelerate's own FSDP path runs.
    `parallelism`: the launch's ParallelismConfig (hybrid sharding), its device mesh built over gloo and checked
    as accelerate does on an accelerator (Accelerator.__init__), now that the state is FSDP2."""
    state = accelerator.state
    state.fsdp_plugin = plugin
    # AcceleratorState copies PartialState's shared fields whenever it is instantiated again: set both.
    PartialState._shared_state["distributed_type"] = state.distributed_type = DistributedType.FSDP
    if parallelism is not None:
        state.parallelism_config = parallelism
        state.device_mesh = parallelism.get_device_mesh("cpu")
        parallelism._validate_accelerator(accelerator)


def mesh_on_multi_cpu(accelerator: Accelerator, parallelism: ParallelismConfig) -> None:
    """Tensor parallelism alone on CPU: the launch's mesh over gloo, which accelerate builds on GPUs (MULTI_GPU)
    and refuses on MULTI_CPU (ParallelismConfig._validate_accelerator); its `prepare` then checks the model's tp
    size and wraps no DDP, as on GPUs."""
    accelerator.state.parallelism_config = parallelism
    accelerator.state.device_mesh = parallelism.get_device_mesh("cpu")


def optimizer_parameter_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[str]]:
    """The name in `model` of each parameter of each of the optimizer's groups."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def repoint_optimizer_parameters(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                                 names: list[list[str]]) -> None:
    """After `prepare` under FSDP2: each group's parameters by name (optimizer_parameter_names) in the prepared
    model. accelerate's FSDP2 preparation re-maps them by the data_ptr of each local shard, and torchao's float8
    wrapper (--mixed_precision fp8) reports 0 for every one: all of them would map to the last float8 weight, the
    others never stepped. By name, every parameter the preparation replaced is found too."""
    parameters = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        group["params"] = [parameters[name] for name in group_names]


def shut_down(accelerator: Accelerator) -> None:
    """End a run's distributed state in an order that cannot deadlock at exit: trackers closed, the wrapped
    model, optimizer and loaders released, then the process groups destroyed.

    The DDP Reducer (and FSDP's and DeepSpeed's state) hold references to the process group. When one of them
    drops the last one, at interpreter exit after the group was destroyed, ProcessGroupGloo's destructor joins
    gloo's worker threads on the main thread, which holds the GIL, while a worker may be waiting for the GIL to
    release a tensor of the work it just finished: both wait forever. Here every rank first finishes its
    collectives (a barrier), the wrappers go while the group is still registered (they drop a reference, never
    the last), a short wait without the GIL lets the workers finish their own clean-up, and only then are the
    groups destroyed, with no work left in flight."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        accelerator.wait_for_everyone()
    # DeepSpeed's engine destroyed, accelerate's references to the wrappers dropped, and a full gc.collect()
    # (accelerate's release_memory): the cycles holding them go now, while the group is registered.
    accelerator.free_memory()
    time.sleep(0.05)  # releases the GIL: a gloo worker finishing a work item can take it
    accelerator.end_training()


def exit_process(code: int) -> NoReturn:
    """End a finished run's process with `code`: the atexit handlers run (loggers, W&B's service, multiprocessing)
    and the streams are flushed, then the interpreter stops without tearing its modules down one by one. That
    teardown costs each rank 2 s with torch, transformers and DeepSpeed loaded, eight ranks at once on a node,
    and runs the C++ destructors (gloo's among them, see shut_down) in an order nothing controls. Call it after
    shut_down: every file the run wrote is closed (checkpoints fsynced) by then."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

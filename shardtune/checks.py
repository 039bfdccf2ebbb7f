"""The recipe's checks that need no model and no data read: values, choices, the packages they need, the output
dir, the batch over the launched ranks. Each raises ConfigError; check_recipe runs them all, collecting each one."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

from shardtune.config import (
    ATTENTION_PACKAGES,
    BITSANDBYTES_OPTIMIZERS,
    COMPILE_MODES,
    FIELD_CHOICES,
    FP8_DIM_MULTIPLE,
    FP8_MIN_CAPABILITY,
    OFFLOADING_NEEDS_RECOMPUTATION,
    OFFLOADING_UNDER_DEEPSPEED_OFFLOAD,
    OPTIMIZER_PACKAGES,
    OPTIMIZERS,
    TORCHAO_OPTIMIZERS,
    TORCHAO_VERSION,
    BatchSizes,
    ConfigError,
    Problems,
    Recipe,
    below_lowest,
)
from shardtune.data_sources import (
    check_chat_template,
    check_dataset_num_proc,
    check_dataset_sources,
    check_dataset_weights,
)
from shardtune.flags import set_fields
from shardtune.float8 import check_fp8
from shardtune.hardware import Hardware, HardwareError, parse_hardware
from shardtune.launch import LaunchDescription
from shardtune.liger import check_liger_device, check_liger_kernel
from shardtune.methods.checks import check_dpo_flags, check_dpo_launch, check_dpo_values, check_reference_model
from shardtune.nvme_checks import AsyncIOReadiness, check_async_io, check_nvme_path, offloads_to_nvme
from shardtune.output_checks import check_async_save, check_checkpoints, check_exports, check_output_dir
from shardtune.parallel.context import check_context_parallel
from shardtune.parallel.sequence import check_sequence_split
from shardtune.parallel.tensor import check_tensor_parallel
from shardtune.schedule import check_schedule


def check_device(recipe: Recipe, has_cuda: bool, local_processes: int = 1, gpus: int = 0) -> None:
    """A node whose CUDA is broken must not train on CPU unnoticed: CPU mode is asked for, or there is a GPU. On
    GPUs, one process per GPU: a config written for several nodes (its num_processes their total) launched on one
    machine without --num_machines starts more processes than the machine has GPUs."""
    if not has_cuda and not recipe.use_cpu:
        raise ConfigError("No CUDA GPU is visible (torch.cuda.is_available() is False): check the node's GPUs and "
                          "driver (nvidia-smi, CUDA_VISIBLE_DEVICES), or pass --use_cpu true to train on CPU.")
    if has_cuda and not recipe.use_cpu and local_processes > gpus:
        raise ConfigError(f"{local_processes} processes were started on this machine, which has {gpus} GPUs: one "
                          "process per GPU. A config's num_processes counts every node's: launch each node with "
                          f"accelerate launch --num_machines N --machine_rank R, or --num_processes {gpus} on one.")


def check_attention(recipe: Recipe, on_gpu: bool, loads: bool = True) -> None:
    """The attention kernel on this device; `loads`: the run will load it (a --dry_run plans it, package or not)."""
    name = recipe.attn_implementation
    if name not in ATTENTION_PACKAGES:
        raise ConfigError(f"--attn_implementation {name!r} is unknown: use one of {', '.join(ATTENTION_PACKAGES)}.")
    package = ATTENTION_PACKAGES[name]
    if package and not on_gpu:
        raise ConfigError(f"--attn_implementation {name} runs on CUDA GPUs only: use sdpa on this machine.")
    if loads and package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"--attn_implementation {name} needs the {package} package, which is not installed: "
                          f"install it (pip install {package.split('_interface')[0].replace('_', '-')}) or use "
                          "sdpa or flex_attention.")
    if name == "flex_attention" and not on_gpu:
        raise ConfigError("--attn_implementation flex_attention has no backward pass on CPU in this torch: use sdpa "
                          "on this machine (flex_attention trains on GPUs).")
    if on_gpu:
        check_packed_attention(recipe)


def check_packed_attention(recipe: Recipe) -> None:
    """On GPUs a packed row needs a kernel that isolates its sequences without a dense mask (the planner plans
    GPUs, so it refuses what a GPU launch refuses)."""
    name = recipe.attn_implementation
    if recipe.packing and name in ("sdpa", "eager"):
        raise ConfigError(f"--packing true with --attn_implementation {name} builds a dense mask over the whole "
                          "packed row (micro-batch x length squared) and leaves the flash kernel: use "
                          "--attn_implementation flash_attention_2 (pip install flash-attn) or flex_attention.")


def check_packing_strategy(recipe: Recipe) -> None:
    """A known strategy, and bfd only with packing: unlike TRL, where a strategy without `packing` is ignored, a
    flag given here acts or is refused."""
    check_choice("--packing_strategy", recipe.packing_strategy, FIELD_CHOICES["packing_strategy"])
    if recipe.packing_strategy == "bfd" and not recipe.packing:
        raise ConfigError("--packing_strategy bfd packs sequences into rows only with --packing true: add "
                          "--packing true, or drop --packing_strategy.")
    if recipe.packing and recipe.packing_strategy != "bfd" and recipe.per_device_train_batch_size == 1:
        raise ConfigError("--packing true at --per_device_train_batch_size 1 packs nothing: padding-free packing "
                          "joins the rows of a micro-batch. Add --packing_strategy bfd to fill rows of "
                          "--max_seq_length tokens, or raise the micro-batch.")


def check_pad_to_multiple_of(recipe: Recipe) -> None:
    """A positive multiple, and under fp8 one of FP8_DIM_MULTIPLE: each float8 weight-gradient matmul takes the
    micro-batch's tokens as its inner dimension, which torch._scaled_mm needs in multiples of 16 on the GPU."""
    multiple = recipe.pad_to_multiple_of
    if multiple is None:
        return
    if too_small := below_lowest([("--pad_to_multiple_of", multiple)]):
        raise ConfigError(too_small)
    if recipe.mixed_precision == "fp8" and multiple % FP8_DIM_MULTIPLE:
        raise ConfigError(f"--pad_to_multiple_of {multiple} under --mixed_precision fp8 would hand float8 matmuls "
                          f"token counts that are not multiples of {FP8_DIM_MULTIPLE}, which torch._scaled_mm refuses: "
                          f"use a multiple of {FP8_DIM_MULTIPLE}, or drop it (fp8 pads to {FP8_DIM_MULTIPLE}).")


def check_inputs_named(recipe: Recipe) -> None:
    """A model and a dataset: every later step needs both. The dataset's sources are judged only when named."""
    missing = [message for value, message in (
        (recipe.model_name_or_path, "No model: set --model_name_or_path to a local model directory or a Hub model id."),
        (recipe.dataset, "No dataset: set --dataset to a local .jsonl/.parquet/.csv file or a dataset directory."),
    ) if not value]
    if missing:
        raise ConfigError(missing)
    check_dataset_sources(recipe)


def check_choice(flag: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)}; got {value!r}.")


def check_choices(recipe: Recipe) -> None:
    problems = Problems()
    for name in ("method", "dataset_format", "truncation", "mixed_precision", "lr_scheduler_type", "optim", "report_to",
                 "gradient_checkpointing_mode"):
        problems.check(check_choice, f"--{name}", getattr(recipe, name), FIELD_CHOICES[name])
    problems.raise_any()


def check_quantization(recipe: Recipe, on_gpu: bool, loads: bool = True) -> None:
    """QLoRA's prerequisites, in the order a user meets them (each later one matters only once the earlier holds).
    `loads`: the run will load the model; a --dry_run plans the 4-bit base without bitsandbytes."""
    if recipe.load_in_4bit and not recipe.use_peft:
        raise ConfigError("--load_in_4bit true quantizes the frozen base for QLoRA: add --use_peft true.")
    if recipe.load_in_4bit and not on_gpu:
        raise ConfigError("--load_in_4bit needs a CUDA GPU: bitsandbytes' 4-bit kernels do not run on this machine. "
                          "Use --use_peft true without --load_in_4bit (LoRA on a 16-bit base).")
    if loads and recipe.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--load_in_4bit needs bitsandbytes: pip install bitsandbytes")


def check_checkpointing_mode(recipe: Recipe, given: frozenset[str] = frozenset()) -> None:
    """--gradient_checkpointing_mode chooses what a checkpointed layer keeps, --gradient_checkpointing_interval
    which layers are checkpointed: without checkpointing neither would act. `given`: the fields on the command
    line (shardtune.flags.given_fields)."""
    if recipe.gradient_checkpointing:
        return
    words = {"gradient_checkpointing_mode": "what checkpointed layers keep",
             "gradient_checkpointing_interval": "which layers are checkpointed"}
    given = [f"--{name} {getattr(recipe, name)} chooses {words[name]}" for name in set_fields(recipe, words, given)]
    if given:
        raise ConfigError(f"{' and '.join(given)}: add --gradient_checkpointing true, or drop "
                          f"{'it' if len(given) == 1 else 'them'}.")


def check_activation_offloading(recipe: Recipe, on_gpu: bool, deepspeed_offloads: bool = False) -> None:
    """TRL's OffloadActivations copies to the host from a CUDA device (it reads the current accelerator, None on a
    CPU-only machine); on CPU the activations are in host memory already. And every decoder layer recomputed: a
    checkpointed layer's own hooks keep all but its input from TRL's (tests/unit/test_checkpointing_modes.py).
    Not beside DeepSpeed's offload, whose pinned-cache limit (distributed.exact_pinned_host_memory) would make
    TRL pin a new host block for every activation of every micro-batch."""
    if not recipe.activation_offloading:
        return
    problems = []
    if not on_gpu:
        problems.append("--activation_offloading moves activations from a CUDA GPU to host memory: on CPU they are "
                        "in host memory already; drop it on this machine.")
    if not recipe.gradient_checkpointing or recipe.gradient_checkpointing_interval != 1:
        problems.append(OFFLOADING_NEEDS_RECOMPUTATION)
    if deepspeed_offloads:
        problems.append(OFFLOADING_UNDER_DEEPSPEED_OFFLOAD)
    if problems:
        raise ConfigError(problems)


def check_torch_compile(recipe: Recipe, given: frozenset[str] = frozenset()) -> None:
    """--torch_compile's backend and mode: each acts only with compilation on, and must be one torch.compile has.
    `given`: the fields on the command line."""
    given = [f"--{name}" for name in set_fields(recipe, ("torch_compile_backend", "torch_compile_mode"), given)]
    if given and not recipe.torch_compile:
        raise ConfigError(f"{' and '.join(given)} configure{'s' if len(given) == 1 else ''} compilation, which runs "
                          "only with --torch_compile true: add it, or drop them.")
    if recipe.torch_compile_mode not in (None, *COMPILE_MODES):
        raise ConfigError(f"--torch_compile_mode {recipe.torch_compile_mode!r} cannot train here: use one of "
                          f"{', '.join(COMPILE_MODES)} (the CUDA-graph modes replay fixed shapes and addresses, "
                          "which varying batches and sharded weights break).")
    if recipe.torch_compile and recipe.gradient_checkpointing and recipe.gradient_checkpointing_mode == "selective" \
            and recipe.torch_compile_backend == "inductor":
        raise ConfigError("--gradient_checkpointing_mode selective saves matmul outputs by their aten op, and inductor "
                          "issues a compiled layer's matmuls as mm.out, which the policy recomputes: with "
                          "--torch_compile use --gradient_checkpointing_mode full.")
    if recipe.torch_compile:
        from torch._dynamo import list_backends  # only with compilation on: importing dynamo takes seconds

        backends = [name for name in list_backends(exclude_tags=()) if name != "cudagraphs"]  # as the modes above
        if recipe.torch_compile_backend not in backends:
            raise ConfigError(f"--torch_compile_backend {recipe.torch_compile_backend!r} is not a torch.compile "
                              f"backend: use inductor, or one of {', '.join(backends)}.")


LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


def check_lora(recipe: Recipe, given: frozenset[str] = frozenset()) -> None:
    """LoRA's shape only with LoRA on: without --use_peft a LoRA flag would be accepted and ignored (a full
    fine-tune), as the planner refuses it too. `given`: the fields on the command line."""
    shaped = [f"--{name}" for name in set_fields(recipe, LORA_FIELDS, given)]
    if shaped and not recipe.use_peft:
        raise ConfigError(f"{', '.join(shaped)} shape{'s' if len(shaped) == 1 else ''} LoRA adapters, which train "
                          "only with --use_peft true: add it, or drop them.")
    if recipe.use_peft and (recipe.lora_r < 1 or recipe.lora_alpha < 1 or not 0 <= recipe.lora_dropout < 1):
        raise ConfigError(f"LoRA needs --lora_r >= 1, --lora_alpha >= 1 and 0 <= --lora_dropout < 1; got "
                          f"{recipe.lora_r}, {recipe.lora_alpha} and {recipe.lora_dropout}.")
    # The tiled loss, and Liger's fused loss in its place, multiply by the head's weight itself
    # (shardtune.tiled_loss): an adapter on it would not train.
    targets = [name.strip() for name in recipe.lora_target_modules.split(",")]
    if recipe.use_peft and recipe.chunked_cross_entropy and "lm_head" in targets and recipe.method != "dpo":
        if recipe.use_liger_kernel:
            raise ConfigError("--lora_target_modules lm_head puts an adapter on the LM head, which Liger's fused "
                              "loss (--use_liger_kernel) multiplies by the head's weight alone: drop "
                              "--use_liger_kernel and add --chunked_cross_entropy false.")
        raise ConfigError("--lora_target_modules lm_head puts an adapter on the LM head, which the tiled loss "
                          "(--chunked_cross_entropy, on by default) bypasses: add --chunked_cross_entropy false.")


def check_compile_under(recipe: Recipe, launch: LaunchDescription) -> None:
    """--torch_compile under ZeRO-3 compiles next to nothing: measured on 2 ranks, DeepSpeed's parameter hooks break
    a compiled layer at every module and its pre-backward hook recompiles per module until dynamo's recompile limit
    (8), after which the layers run eager."""
    if recipe.torch_compile and launch.uses_deepspeed and str(launch.deepspeed_settings.get("stage")) == "3":
        raise ConfigError("--torch_compile under ZeRO-3: DeepSpeed's parameter hooks break each compiled layer at "
                          "every module and recompile it until dynamo's recompile limit, then it runs eager: "
                          "compile under FSDP2, ZeRO-1/2 or DDP, or drop --torch_compile.")


def check_optimizer(recipe: Recipe, on_gpu: bool, launch_kind: str, world_size: int = 1, loads: bool = True,
                    replicated: bool = False) -> None:
    """What --optim and --bf16_stochastic_round need from the launch and the machine, in the order a user meets
    it. `launch_kind`: "ddp", "fsdp" or "deepspeed" (LaunchDescription.kind). `loads`: the run will build the
    optimizer (a --dry_run plans it without the package). `replicated`: FSDP2's hybrid sharding, each shard held
    by one rank per node."""
    optim, stochastic = recipe.optim, recipe.bf16_stochastic_round
    if optim not in OPTIMIZERS or (optim == "adamw_torch" and not stochastic):
        return
    named = f"--optim {optim}" + (" --bf16_stochastic_round" if stochastic else "")
    if launch_kind == "deepspeed":
        raise ConfigError(f"{named} cannot step under DeepSpeed, whose ZeRO optimizer keeps its own fp32 master "
                          "partitions and steps them itself: launch with a DDP or FSDP config, or use --optim "
                          "adamw_torch without --bf16_stochastic_round.")
    if stochastic and optim in BITSANDBYTES_OPTIMIZERS:
        raise ConfigError(f"--bf16_stochastic_round is torchao's: bitsandbytes' {optim} has none; use --optim "
                          "adamw_torch_8bit (torchao) with it.")
    if stochastic and recipe.mixed_precision != "bf16":
        raise ConfigError(f"--bf16_stochastic_round trains bf16 weights: it needs --mixed_precision bf16, got "
                          f"{recipe.mixed_precision}.")
    if stochastic and launch_kind == "ddp" and world_size > 1:
        raise ConfigError("--bf16_stochastic_round rounds each weight with a random draw, and DDP's replicas draw "
                          "independently, so they would drift apart: launch with an FSDP config (each rank rounds "
                          "its own shard) or one process.")
    if stochastic and replicated:
        raise ConfigError("--bf16_stochastic_round rounds each weight with a random draw, and hybrid sharding's "
                          "replicas of a shard (one per node) draw independently, so they would drift apart: "
                          "launch with accelerate_configs/fsdp_full_shard.yaml across the nodes.")
    if stochastic and recipe.use_peft:
        raise ConfigError("--bf16_stochastic_round rounds bf16 weights, and LoRA's adapters train in fp32 (their "
                          "base is frozen): leave it out with --use_peft true.")
    if recipe.async_save and optim in TORCHAO_OPTIMIZERS:
        raise ConfigError(f"--async_save true copies the optimizer's states with torch.distributed.checkpoint's "
                          f"stager, which cannot copy torchao's quantized states of --optim {optim} (no new_empty): "
                          "drop --async_save (saves are then synchronous).")
    if optim in BITSANDBYTES_OPTIMIZERS and not on_gpu:
        raise ConfigError(f"--optim {optim} runs bitsandbytes' CUDA kernels: on this machine use --optim "
                          "adamw_torch_8bit (torchao's 8-bit AdamW, which runs on CPU).")
    if optim in BITSANDBYTES_OPTIMIZERS and launch_kind == "fsdp":
        raise ConfigError(f"--optim {optim}: bitsandbytes' optimizers do not step FSDP2's DTensor shards: use "
                          "--optim adamw_torch_8bit (torchao) under FSDP.")
    package = "torchao" if stochastic else OPTIMIZER_PACKAGES[optim]
    if loads and importlib.util.find_spec(package) is None:
        pin = f"torchao=={TORCHAO_VERSION}" if package == "torchao" else package
        raise ConfigError(f"{named} needs {package}, which is not installed: pip install {pin}")


def check_loss_scaler(recipe: Recipe, on_gpu: bool, uses_deepspeed: bool) -> None:
    if recipe.mixed_precision == "fp16" and not (on_gpu or uses_deepspeed):
        raise ConfigError(
            "--mixed_precision fp16 needs a loss scaler, and accelerate has none without a GPU: fp16 would train "
            "unscaled (or silently in fp32). Use --mixed_precision bf16 or no."
        )


def check_numbers(recipe: Recipe) -> None:
    """Hyper-parameters, step counts and timeouts within their ranges; every one out of range is reported."""
    problems = Problems()
    if not 0.0 < recipe.eval_fraction < 1.0:
        problems.messages.append(f"--eval_fraction must be between 0 and 1 (exclusive), got {recipe.eval_fraction}.")
    if not recipe.learning_rate > 0:  # also NaN
        problems.messages.append(f"--learning_rate must be > 0, got {recipe.learning_rate}: give e.g. "
                                 "--learning_rate 1e-5.")
    # TrainingArguments' -1 means "not set: train the epochs"; transformers reads 0 (and below) the same way, which
    # makes `--max_steps 0` a whole epoch: refused, like every other negative.
    if recipe.max_steps == 0 or recipe.max_steps < -1:
        problems.messages.append(f"--max_steps must be > 0 (optimizer steps), or -1 to train --num_train_epochs "
                                 f"epochs; got {recipe.max_steps}.")
    elif recipe.num_train_epochs < 0 or (recipe.max_steps == -1 and recipe.num_train_epochs == 0):
        problems.messages.append(f"Nothing to train: --num_train_epochs {recipe.num_train_epochs} with --max_steps "
                                 f"{recipe.max_steps}; set --max_steps > 0 or --num_train_epochs > 0.")
    problems.messages.extend(below_lowest((flag, getattr(recipe, flag[2:])) for flag in (
        "--max_seq_length", "--per_device_eval_batch_size", "--gradient_checkpointing_interval", "--logging_steps",
        "--eval_steps", "--save_steps", "--save_total_limit")))
    problems.messages.extend(optimizer_number_problems(recipe))
    for name in ("collective_timeout_minutes", "startup_timeout_minutes", "rank_timeout_s"):
        if not getattr(recipe, name) > 0:
            problems.messages.append(f"--{name} must be > 0, got {getattr(recipe, name)}.")
    problems.check(check_schedule, recipe)
    problems.raise_any()


def optimizer_number_problems(recipe: Recipe) -> list[str]:
    """AdamW's and clipping's numbers within the ranges torch takes (torch.optim.AdamW raises on the rest only
    once the model is loaded; a negative clipping norm would turn every gradient around)."""
    problems = [f"--{name} must be in [0, 1), got {value}: e.g. --adam_beta1 0.9 --adam_beta2 0.95."
                for name, value in (("adam_beta1", recipe.adam_beta1), ("adam_beta2", recipe.adam_beta2))
                if not 0.0 <= value < 1.0]
    problems += [f"--{name} must be >= 0, got {value}{hint}." for name, value, hint in (
        ("adam_epsilon", recipe.adam_epsilon, ": e.g. 1e-8"), ("weight_decay", recipe.weight_decay, ": 0 for none"),
        ("max_grad_norm", recipe.max_grad_norm, ": 0 clips nothing")) if not value >= 0]
    return problems


def check_tracking(recipe: Recipe) -> None:
    if recipe.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--report_to wandb needs wandb, which is not installed: pip install wandb, or pass "
                          "--report_to none.")


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
    from shardtune.distributed import check_deepspeed_fp16  # torch is imported by now (cli.checked_launch)
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

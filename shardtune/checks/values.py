"""The recipe's values and what each needs: choices, numbers, the attention kernel, packing, LoRA, compile,
the optimizer and its precision, activation offloading, this machine's device. Each raises ConfigError; the
start-up checks (checks.startup) run them all and report every failure together."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from shardtune.config import (
    ATTENTION_PACKAGES,
    BITSANDBYTES_OPTIMIZERS,
    COMPILE_MODES,
    FIELD_CHOICES,
    FP8_DIM_MULTIPLE,
    OFFLOADING_NEEDS_RECOMPUTATION,
    OFFLOADING_UNDER_DEEPSPEED_OFFLOAD,
    OPTIMIZER_PACKAGES,
    OPTIMIZERS,
    TORCHAO_OPTIMIZERS,
    TORCHAO_VERSION,
    ConfigError,
    Problems,
    Recipe,
    below_lowest,
)
from shardtune.data.sources import (
    check_dataset_sources,
)
from shardtune.flags import set_fields
from shardtune.launch import LaunchDescription
from shardtune.schedule import check_schedule


def check_device(recipe: Recipe, has_cuda: bool, local_processes: int = 1, gpus: int = 0) -> None:
    """A node whose CUDA is broken must not train on CPU unnoticed: CPU mode is asked for, or there is a GPU. On
    GPUs, one process per GPU: a config written for several nodes (its num_processes their total) launched on one
    machine without --num_machines starts more processes than the machine has GPUs."""
    if not has_cuda and not recipe.use_cpu:
        raise ConfigError("No CUDA GPU is visible (torch.cuda.is_available() is False): check the node's GPUs and "
                          "driver (nvidia-smi, CUDA_VISIBLE_DEVICES), or pass --use_cpu true to train on CPU.")
    if has_cuda and not recipe.use_cpu and 0 < gpus < local_processes:  # 0: none counted (a faked GPU)
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
    Not beside DeepSpeed's offload, whose pinned-cache limit (parallel.pinned_memory.exact_pinned_host_memory) would
    make TRL pin a new host block for every activation of every micro-batch."""
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
    # (shardtune.levers.tiled_loss): an adapter on it would not train.
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

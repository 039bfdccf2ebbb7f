"""The recipe: every value a run needs, overridable from the command line, checked before any heavy work."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import NoReturn

from transformers import HfArgumentParser

MIXED_PRECISIONS = ("bf16", "fp16", "no")
DATASET_FORMATS = ("auto", "text", "prompt_completion", "messages")
DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# transformers' schedulers that need neither extra arguments nor a metric at every step (the trainer gives neither).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")
ZERO_STAGES = ("1", "2", "3")
# transformers' attention implementations for training, and the package each needs beyond torch.
ATTENTION_PACKAGES = {"sdpa": None, "eager": None, "flex_attention": None, "flash_attention_2": "flash_attn",
                      "flash_attention_3": "flash_attn_interface"}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


class ConfigError(ValueError):
    """A bad recipe value, flag or environment: printed as one line, exit code 2, nothing loaded."""


@dataclass
class Recipe:
    """What a recipe declares. Field names follow transformers' TrainingArguments where one exists."""

    name: str = field(default="run", metadata={"help": "Recipe name; the default output dir is outputs/<name>."})
    model_name_or_path: str = field(default="", metadata={"help": "Hub model id or local model directory."})
    dataset: str = field(default="", metadata={
        "help": "A local .json/.jsonl/.parquet/.csv file, a `save_to_disk` directory, or a Hub dataset name."})
    dataset_split: str = "train"
    eval_split: str = field(default="", metadata={"help": "A held-out split of --dataset; default: --eval_fraction."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of the data held out for eval."})
    dataset_format: str = field(default="auto", metadata={
        "help": "auto (from the columns), text, prompt_completion or messages (chat, via the chat template)."})
    completion_only_loss: bool = field(default=True, metadata={
        "help": "Loss on completion / assistant tokens only; false: on every token."})
    truncation: str = field(default="truncate", metadata={"help": "Rows over --max_seq_length: truncate or drop."})
    packing: bool = field(default=False, metadata={
        "help": "Padding-free: each micro-batch is one row of its sequences, attention isolated per sequence."})
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters; the base stays frozen."})
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: str = field(default="all-linear", metadata={
        "help": "all-linear, or comma-separated module names (q_proj,v_proj)."})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA: the frozen base in 4-bit NF4 (bitsandbytes, CUDA GPUs); needs --use_peft."})
    output_dir: str = field(default="", metadata={"help": "Where metrics, W&B files and the model go."})
    max_seq_length: int = 2048
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 8
    global_batch_size: int | None = field(
        default=None, metadata={"help": "Sequences per optimizer step over all ranks; accumulation is derived."}
    )
    gradient_accumulation_steps: int | None = field(
        default=None, metadata={"help": "Micro-batches per optimizer step; must agree with --global_batch_size."}
    )
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = field(default="cosine", metadata={"help": f"One of {', '.join(LR_SCHEDULERS)}."})
    warmup_ratio: float = 0.03
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1 means num_train_epochs."})
    num_train_epochs: int = 1
    gradient_checkpointing: bool = True
    gradient_checkpointing_interval: int = field(
        default=1, metadata={"help": "Recompute every k-th decoder layer (1 = all layers)."}
    )
    mixed_precision: str = field(default="bf16", metadata={"help": "bf16, fp16 (with a loss scaler) or no (fp32)."})
    attn_implementation: str = field(default="sdpa", metadata={
        "help": f"One of {', '.join(ATTENTION_PACKAGES)}. With --packing on a GPU: flash_attention_2 or "
                "flex_attention (SDPA and eager build a dense mask over the packed row)."})
    use_cpu: bool = field(default=False, metadata={
        "help": "Train on CPU over gloo (tests, demos). Without it a machine with no visible CUDA GPU is an error, "
                "not a silent CPU run."})
    seed: int = 42
    logging_steps: int = 10
    eval_steps: int = field(default=0, metadata={"help": "Eval every N steps; 0 = only at the end."})
    report_to: str = field(default="wandb", metadata={"help": "wandb or none."})
    wandb_project: str = "shardtune"
    run_name: str = ""
    save_model: bool = field(default=True, metadata={"help": "Save the final model in Hugging Face format."})
    save_steps: int = field(default=500, metadata={"help": "Checkpoint every N steps and at the end; 0 = never."})
    save_total_limit: int = field(default=2, metadata={"help": "Keep the newest K checkpoints; 0 = keep all."})
    save_only_model: bool = field(default=False, metadata={
        "help": "Checkpoints hold the model only (no optimizer, scheduler or RNG state): they export, not resume."})
    async_save: bool = field(default=False, metadata={
        "help": "Copy the state to host memory, write it in the background while training goes on (costs host RAM "
                "equal to each rank's checkpoint shard)."})
    resume_from_checkpoint: str = field(
        default="", metadata={"help": "`auto` (newest complete checkpoint in output_dir, if any) or a path."}
    )
    hardware: str = field(
        default="", metadata={"help": "Plan memory for this hardware at start-up (e.g. 8xh100-80gb); "
                              "default: the GPUs found. A plan that does not fit stops the run before loading."}
    )
    dry_run: bool = field(default=False, metadata={"help": "Print the memory plan and exit."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Delete an earlier run in output_dir instead of refusing to start."}
    )
    offload_nvme_path: str = field(default="", metadata={
        "help": "A directory on local NVMe for ds_zero3_nvme_offload.yaml's swap files (accelerate launch does not "
                "pass the config file's NVMe paths on)."})
    collective_timeout_minutes: float = field(default=10, metadata={
        "help": "A training collective that waits longer fails the job instead of hanging."})
    startup_timeout_minutes: float = field(default=30, metadata={
        "help": "The same for start-up (weights load on one rank) and checkpoint saves."})
    rank_timeout_s: float = field(default=60, metadata={
        "help": "A rank silent this long is taken as dead: every rank stops with a message naming it."})

    @property
    def resolved_output_dir(self) -> str:
        return self.output_dir or os.path.join("outputs", self.name)


@dataclass(frozen=True)
class BatchPlan:
    """global_batch_size = per_device_train_batch_size x gradient_accumulation_steps x data-parallel size."""

    micro_batch: int
    accumulation: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size


def launch_env() -> tuple[int, bool, bool]:
    """(world size, DeepSpeed?, FSDP?) as `accelerate launch` set them, readable before any process group.
    Raises ConfigError for a launch environment in which the ranks could not meet or the trainer could not run."""
    world_size = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    if world_size < 1:
        raise ConfigError(f"WORLD_SIZE is {world_size}; unset it and start the run with accelerate launch, "
                          "which sets it to the number of processes.")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"RANK {rank} does not fit WORLD_SIZE {world_size} (ranks run from 0 to {world_size - 1}): relaunch "
            "with accelerate launch, giving every node the same --num_machines and --num_processes and its own "
            "--machine_rank."
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if world_size > 1 and not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE is {world_size} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            "set, so the ranks cannot find each other: launch every node with accelerate launch --num_machines N "
            "--machine_rank R --main_process_ip <rank-0 node address> --main_process_port <free port>."
        )
    uses_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    uses_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if uses_deepspeed:
        check_deepspeed_env()
    if uses_fsdp:
        check_fsdp_env()
    return world_size, uses_deepspeed, uses_fsdp


def env_int(name: str, default: int) -> int:
    """An integer launch variable; unset or empty gives `default`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number; unset it and start the run with accelerate "
                          "launch, which sets it.") from None


def check_deepspeed_env() -> None:
    """The DeepSpeed settings `accelerate launch` exported from the config's deepspeed_config."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("The accelerate config uses DeepSpeed, which is not installed: pip install deepspeed, "
                          "or launch with an FSDP or DDP config.")
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")  # unset when a DeepSpeed JSON file sets the stage
    if stage is not None and stage.strip() not in ZERO_STAGES:
        raise ConfigError(f"The accelerate config sets zero_stage {stage!r}; shardtune trains with ZeRO stage 1, 2 "
                          "or 3: set one of these in its deepspeed_config (or use ddp.yaml for no sharding).")
    for kind in ("optimizer", "param"):
        device = os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none").strip().lower()
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(f"The accelerate config sets offload_{kind}_device {device!r}; set it to one of "
                              f"{', '.join(OFFLOAD_DEVICES)} in its deepspeed_config.")
        # Below ZeRO-3, DeepSpeed ignores parameter offload and keeps an NVMe optimizer offload in CPU RAM.
        if stage is not None and stage.strip() != "3" and (kind == "param" or device == "nvme") and device != "none":
            raise ConfigError(f"offload_{kind}_device {device} needs ZeRO stage 3 and the accelerate config sets "
                              f"zero_stage {stage.strip()}: set zero_stage: 3 or offload_{kind}_device: none.")


def check_fsdp_env() -> None:
    """The FSDP settings `accelerate launch` exported from the config's fsdp_config: the trainer runs FSDP2."""
    version = os.environ.get("FSDP_VERSION", "1").strip()  # accelerate's own default is FSDP1
    if version != "2":
        raise ConfigError(f"The accelerate config runs FSDP version {version} and shardtune's trainer is written "
                          "for FSDP2: set fsdp_version: 2 in its fsdp_config.")
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower()
    if reshard not in ("true", "false"):
        raise ConfigError(f"fsdp_reshard_after_forward {reshard.upper()!r} is an FSDP1 strategy; FSDP2 takes true "
                          "(like FULL_SHARD) or false (like SHARD_GRAD_OP): set one of these in the fsdp_config.")
    strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().upper()
    if strategy not in ("FULL_SHARD", "1"):  # `accelerate launch` exports FULL_SHARD unless the config says more
        raise ConfigError(f"fsdp_sharding_strategy {strategy} is an FSDP1 setting that FSDP2 ignores (the run would "
                          "fully shard): remove it, and set fsdp_reshard_after_forward: false for SHARD_GRAD_OP.")


def check_nvme_path(recipe: Recipe, uses_deepspeed: bool) -> None:
    """NVMe offload needs --offload_nvme_path, and the flag needs NVMe offload: accelerate launch does not pass a
    config's nvme paths to the script, so DeepSpeed would write its swap files to ./none."""
    offloaded = [kind for kind in ("optimizer", "param") if uses_deepspeed and os.environ.get(
        f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none").strip().lower() == "nvme"]
    path = recipe.offload_nvme_path
    if offloaded and not path:
        raise ConfigError(f"The accelerate config offloads the {' and '.join(offloaded)} states to NVMe: pass "
                          "--offload_nvme_path <directory on a local NVMe disk>.")
    if path and not offloaded:
        raise ConfigError("--offload_nvme_path is used only with NVMe offload (ds_zero3_nvme_offload.yaml): drop it "
                          "or launch with that config.")
    if path and not os.path.isdir(path):
        raise ConfigError(f"--offload_nvme_path {path!r} is not a directory: create it on a local NVMe disk.")


class RecipeParser(HfArgumentParser):
    """argparse's own errors (a bad value such as `--packing maybe`) as ConfigError: one line, exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"Bad command line: {message.rstrip('.')}; see --help for the recipe's flags.")


def parse_recipe(recipe: Recipe, argv: list[str] | None = None) -> Recipe:
    """Apply command-line overrides (`--learning_rate 2e-5`, `--gradient_checkpointing false`) to a recipe."""
    parser = RecipeParser(Recipe)
    parser.allow_abbrev = False  # a typo such as --learning_rat must not pass as --learning_rate
    parser.set_defaults(**dataclasses.asdict(recipe))
    args = sys.argv[1:] if argv is None else argv
    overridden, unknown = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
    if unknown:
        raise ConfigError(f"Unknown argument(s): {' '.join(unknown)}. See --help for the recipe's flags.")
    return overridden


def check_dataset_path(dataset: str) -> None:
    """A local file of a known type or a `save_to_disk` directory; anything that does not look like a path is taken
    as a Hub dataset name (checked when it loads)."""
    suffix = os.path.splitext(dataset)[1].lower()
    # Hub names are `name` or `org/name`: a file suffix, a leading `.`, `/` or `~`, or deeper nesting is a path.
    looks_local = suffix in DATA_FILE_TYPES or dataset.startswith((".", "/", "~")) or dataset.count("/") > 1
    if os.path.isdir(dataset):
        markers = ("dataset_info.json", "dataset_dict.json")
        if not any(os.path.exists(os.path.join(dataset, marker)) for marker in markers):
            raise ConfigError(f"--dataset {dataset!r} is a directory but not one written by `save_to_disk`; "
                              "give a data file or a saved dataset.")
    elif os.path.isfile(dataset):
        if suffix not in DATA_FILE_TYPES:
            raise ConfigError(f"--dataset {dataset!r}: unknown file type {suffix!r}; use one of "
                              f"{', '.join(DATA_FILE_TYPES)} or a `save_to_disk` directory.")
        if os.path.getsize(dataset) == 0:
            raise ConfigError(f"The data file {dataset!r} is empty; give --dataset a file with training rows.")
    elif looks_local:
        raise ConfigError(f"Dataset file not found: {dataset!r}. Check the path given to --dataset.")


def plan_batches(recipe: Recipe, world_size: int) -> BatchPlan:
    micro, gas, total = recipe.per_device_train_batch_size, recipe.gradient_accumulation_steps, recipe.global_batch_size
    if micro < 1:
        raise ConfigError(f"--per_device_train_batch_size must be >= 1, got {micro}.")
    if gas is not None and gas < 1:
        raise ConfigError(f"--gradient_accumulation_steps must be >= 1, got {gas}.")
    per_step = micro * world_size
    if total is None:
        return BatchPlan(micro, gas or 1, world_size)
    if total % per_step:
        raise ConfigError(
            f"--global_batch_size {total} is not divisible by per_device_train_batch_size x processes "
            f"= {micro} x {world_size} = {per_step}. Pick a global batch that is a multiple of {per_step}, "
            "or change --per_device_train_batch_size."
        )
    if gas is not None and gas * per_step != total:
        raise ConfigError(
            f"--gradient_accumulation_steps {gas} disagrees with --global_batch_size {total}: "
            f"{micro} x {gas} x {world_size} processes = {gas * per_step}. Give only one of the two."
        )
    return BatchPlan(micro, total // per_step, world_size)


def check_device(recipe: Recipe, has_cuda: bool) -> None:
    """A node whose CUDA is broken must not train on CPU unnoticed: CPU mode is asked for, or there is a GPU."""
    if not has_cuda and not recipe.use_cpu:
        raise ConfigError("No CUDA GPU is visible (torch.cuda.is_available() is False): check the node's GPUs and "
                          "driver (nvidia-smi, CUDA_VISIBLE_DEVICES), or pass --use_cpu true to train on CPU.")


def check_attention(recipe: Recipe, on_gpu: bool) -> None:
    name = recipe.attn_implementation
    if name not in ATTENTION_PACKAGES:
        raise ConfigError(f"--attn_implementation {name!r} is unknown: use one of {', '.join(ATTENTION_PACKAGES)}.")
    package = ATTENTION_PACKAGES[name]
    if package and not on_gpu:
        raise ConfigError(f"--attn_implementation {name} runs on CUDA GPUs only: use sdpa on this machine.")
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"--attn_implementation {name} needs the {package} package, which is not installed: "
                          f"install it (pip install {package.split('_interface')[0].replace('_', '-')}) or use "
                          "sdpa or flex_attention.")
    if name == "flex_attention" and not on_gpu:
        raise ConfigError("--attn_implementation flex_attention has no backward pass on CPU in this torch: use sdpa "
                          "on this machine (flex_attention trains on GPUs).")
    if recipe.packing and on_gpu and name in ("sdpa", "eager"):
        raise ConfigError(f"--packing true with --attn_implementation {name} builds a dense mask over the whole "
                          "packed row (micro-batch x length squared) and leaves the flash kernel: use "
                          "--attn_implementation flash_attention_2 (pip install flash-attn) or flex_attention.")


def validate(recipe: Recipe, world_size: int, uses_deepspeed: bool, has_gpu: bool) -> BatchPlan:
    """Every check that needs no model and no data loaded. `has_gpu`: CUDA is available. Raises ConfigError."""
    check_device(recipe, has_gpu)
    has_gpu = has_gpu and not recipe.use_cpu
    check_attention(recipe, has_gpu)
    if not recipe.model_name_or_path:
        raise ConfigError("No model: set --model_name_or_path to a local model directory or a Hub model id.")
    if not recipe.dataset:
        raise ConfigError("No dataset: set --dataset to a local .jsonl/.parquet/.csv file or a dataset directory.")
    check_dataset_path(recipe.dataset)
    for name, value, choices in (("--dataset_format", recipe.dataset_format, DATASET_FORMATS),
                                 ("--truncation", recipe.truncation, ("truncate", "drop"))):
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}.")
    if recipe.load_in_4bit and not recipe.use_peft:
        raise ConfigError("--load_in_4bit true quantizes the frozen base for QLoRA: add --use_peft true.")
    if recipe.load_in_4bit and not has_gpu:
        raise ConfigError("--load_in_4bit needs a CUDA GPU: bitsandbytes' 4-bit kernels do not run on this machine. "
                          "Use --use_peft true without --load_in_4bit (LoRA on a 16-bit base).")
    if recipe.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--load_in_4bit needs bitsandbytes: pip install bitsandbytes")
    if recipe.use_peft and (recipe.lora_r < 1 or recipe.lora_alpha < 1 or not 0 <= recipe.lora_dropout < 1):
        raise ConfigError(f"LoRA needs --lora_r >= 1, --lora_alpha >= 1 and 0 <= --lora_dropout < 1; got "
                          f"{recipe.lora_r}, {recipe.lora_alpha} and {recipe.lora_dropout}.")
    if recipe.mixed_precision not in MIXED_PRECISIONS:
        choices = ", ".join(MIXED_PRECISIONS)
        raise ConfigError(f"--mixed_precision must be one of {choices}; got {recipe.mixed_precision!r}.")
    if recipe.mixed_precision == "fp16" and not (has_gpu or uses_deepspeed):
        raise ConfigError(
            "--mixed_precision fp16 needs a loss scaler, and accelerate has none without a GPU: fp16 would train "
            "unscaled (or silently in fp32). Use --mixed_precision bf16 or no."
        )
    if not 0.0 < recipe.eval_fraction < 1.0:
        raise ConfigError(f"--eval_fraction must be between 0 and 1 (exclusive), got {recipe.eval_fraction}.")
    if not recipe.learning_rate > 0:  # also NaN
        raise ConfigError(f"--learning_rate must be > 0, got {recipe.learning_rate}: give e.g. --learning_rate 1e-5.")
    if not 0.0 <= recipe.warmup_ratio <= 1.0:
        raise ConfigError(f"--warmup_ratio is the share of steps spent warming up: between 0 and 1, got "
                          f"{recipe.warmup_ratio}.")
    if recipe.lr_scheduler_type not in LR_SCHEDULERS:
        raise ConfigError(f"--lr_scheduler_type must be one of {', '.join(LR_SCHEDULERS)}; got "
                          f"{recipe.lr_scheduler_type!r}.")
    if recipe.max_steps <= 0 and recipe.num_train_epochs <= 0:
        raise ConfigError("Nothing to train: set --max_steps > 0 or --num_train_epochs > 0.")
    for name, value, lowest in (("--max_seq_length", recipe.max_seq_length, 2),  # a token and one to predict
                                ("--per_device_eval_batch_size", recipe.per_device_eval_batch_size, 1),
                                ("--gradient_checkpointing_interval", recipe.gradient_checkpointing_interval, 1),
                                ("--logging_steps", recipe.logging_steps, 1),
                                ("--eval_steps", recipe.eval_steps, 0),
                                ("--save_steps", recipe.save_steps, 0),
                                ("--save_total_limit", recipe.save_total_limit, 0)):
        if value < lowest:
            raise ConfigError(f"{name} must be >= {lowest}, got {value}.")
    if recipe.report_to not in ("wandb", "none"):
        raise ConfigError(f"--report_to must be wandb or none, got {recipe.report_to!r}.")
    check_nvme_path(recipe, uses_deepspeed)
    for name in ("collective_timeout_minutes", "startup_timeout_minutes", "rank_timeout_s"):
        if not getattr(recipe, name) > 0:
            raise ConfigError(f"--{name} must be > 0, got {getattr(recipe, name)}.")
    if recipe.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--report_to wandb needs wandb, which is not installed: pip install wandb, or pass "
                          "--report_to none.")
    resume = recipe.resume_from_checkpoint
    if recipe.save_only_model and resume == "auto":
        raise ConfigError("--save_only_model true writes checkpoints without optimizer states, which cannot resume "
                          "training: drop --resume_from_checkpoint auto or --save_only_model true.")
    if recipe.save_only_model and recipe.use_peft:
        raise ConfigError("--save_only_model true is for full fine-tuning; a LoRA checkpoint's optimizer states are "
                          "small: drop --save_only_model true.")
    if resume and resume != "auto" and not os.path.isdir(resume):
        raise ConfigError(f"--resume_from_checkpoint {resume!r} is not a directory: give a checkpoint "
                          "(<output_dir>/checkpoint-<step>), or `auto` for the newest complete one in --output_dir.")
    output_dir = recipe.resolved_output_dir
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"--output_dir {output_dir!r} is a file; give a directory.")
    occupied = os.path.isdir(output_dir) and any(not name.startswith(".") for name in os.listdir(output_dir))
    if occupied and not (recipe.resume_from_checkpoint or recipe.overwrite_output_dir):
        raise ConfigError(
            f"--output_dir {output_dir!r} already holds files of another run. Resume it with "
            "--resume_from_checkpoint auto, replace it with --overwrite_output_dir true, or pick another directory."
        )
    return plan_batches(recipe, world_size)

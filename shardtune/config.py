"""The recipe: every value a run needs, overridable from the command line, checked before any heavy work."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

MIXED_PRECISIONS = ("bf16", "fp16", "no")
DATASET_FORMATS = ("auto", "text", "prompt_completion", "messages")
DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


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
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Any transformers scheduler name."})
    warmup_ratio: float = 0.03
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1 means num_train_epochs."})
    num_train_epochs: int = 1
    gradient_checkpointing: bool = True
    gradient_checkpointing_interval: int = field(
        default=1, metadata={"help": "Recompute every k-th decoder layer (1 = all layers)."}
    )
    mixed_precision: str = field(default="bf16", metadata={"help": "bf16, fp16 (with a loss scaler) or no (fp32)."})
    attn_implementation: str = "sdpa"
    seed: int = 42
    logging_steps: int = 10
    eval_steps: int = field(default=0, metadata={"help": "Eval every N steps; 0 = only at the end."})
    report_to: str = field(default="wandb", metadata={"help": "wandb or none."})
    wandb_project: str = "shardtune"
    run_name: str = ""
    save_model: bool = field(default=True, metadata={"help": "Save the final model in Hugging Face format."})
    save_steps: int = field(default=500, metadata={"help": "Checkpoint every N steps and at the end; 0 = never."})
    save_total_limit: int = field(default=2, metadata={"help": "Keep the newest K checkpoints; 0 = keep all."})
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
    """(world size, DeepSpeed?, FSDP?) as `accelerate launch` set them, readable before any process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    uses_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    uses_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    return world_size, uses_deepspeed, uses_fsdp


def parse_recipe(recipe: Recipe, argv: list[str] | None = None) -> Recipe:
    """Apply command-line overrides (`--learning_rate 2e-5`, `--gradient_checkpointing false`) to a recipe."""
    parser = HfArgumentParser(Recipe)
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


def validate(recipe: Recipe, world_size: int, uses_deepspeed: bool, has_gpu: bool) -> BatchPlan:
    """Every check that needs no model and no data loaded. Raises ConfigError."""
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
        raise ConfigError("LoRA needs --lora_r >= 1, --lora_alpha >= 1 and 0 <= --lora_dropout < 1.")
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
    if recipe.max_steps <= 0 and recipe.num_train_epochs <= 0:
        raise ConfigError("Nothing to train: set --max_steps > 0 or --num_train_epochs > 0.")
    if recipe.gradient_checkpointing_interval < 1:
        raise ConfigError(
            f"--gradient_checkpointing_interval must be >= 1, got {recipe.gradient_checkpointing_interval}."
        )
    if recipe.report_to not in ("wandb", "none"):
        raise ConfigError(f"--report_to must be wandb or none, got {recipe.report_to!r}.")
    if recipe.logging_steps < 1:
        raise ConfigError(f"--logging_steps must be >= 1, got {recipe.logging_steps}.")
    if recipe.save_steps < 0 or recipe.save_total_limit < 0:
        raise ConfigError("--save_steps and --save_total_limit must be >= 0.")
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

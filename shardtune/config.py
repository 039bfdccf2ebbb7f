"""The recipe: every value a run needs, overridable from the command line, checked before any heavy work."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

MIXED_PRECISIONS = ("bf16", "fp16", "no")
DATASET_FORMATS = ("auto", "text", "prompt_completion", "messages", "alpaca", "sharegpt")
DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# transformers' schedulers that need neither extra arguments nor a metric at every step (the trainer gives neither).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")
ZERO_STAGES = ("1", "2", "3")
# transformers' attention implementations for training, and the package each needs beyond torch.
ATTENTION_PACKAGES = {"sdpa": None, "eager": None, "flex_attention": None, "flash_attention_2": "flash_attn",
                      "flash_attention_3": "flash_attn_interface"}
# How the memory planner models each of them (the same names, in the planner CLI's order): SDPA and eager take a
# dense mask; the flash kernels (flash-attn's varlen kernels, flex attention's block mask) none.
PLANNED_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash", "flash_attention_3": "flash",
                     "flex_attention": "flash"}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
SAVE_DTYPES = ("auto", "bf16", "fp16", "fp32")
# Positions of the eval's logits upcast to fp32 at once (shardtune.evaluation), as the planner counts them.
EVAL_CHUNK_POSITIONS = 1024


class ConfigError(ValueError):
    """Bad recipe values, flags or environment: each message printed as one line, exit code 2, nothing loaded.
    Carries one message, or several when checks were collected (see Problems)."""

    def __init__(self, messages: str | Sequence[str]) -> None:
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


T = TypeVar("T")


class Problems:
    """Runs checks and keeps every ConfigError instead of stopping at the first, so that a user with three
    mistakes learns all three from one launch."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def check(self, check: Callable[..., T], *args: object) -> T | None:
        """check(*args)'s result, or None once its ConfigError is recorded (so a check that returns a value tells
        its dependants whether to run)."""
        try:
            return check(*args)
        except ConfigError as error:
            self.messages.extend(error.messages)
            return None

    def raise_any(self) -> None:
        """Raise one ConfigError with every message recorded, if any."""
        if self.messages:
            raise ConfigError(self.messages)


@dataclass
class Recipe:
    """What a recipe declares. Field names follow transformers' TrainingArguments where one exists."""

    name: str = field(default="run", metadata={"help": "Recipe name; the default output dir is outputs/<name>."})
    model_name_or_path: str = field(default="", metadata={"help": "Hub model id or local model directory."})
    dataset: str = field(default="", metadata={
        "help": "A local .json/.jsonl/.parquet/.csv file, a `save_to_disk` directory, or a Hub dataset name; "
                "several, separated by commas, are mixed (see --dataset_weights)."})
    dataset_weights: str = field(default="", metadata={
        "help": "With several --dataset sources: the share of each source's rows to take, comma-separated "
                "(1.0 = all of it, 0.5 = half, drawn with --seed); default: all of every source."})
    dataset_split: str = "train"
    eval_split: str = field(default="", metadata={"help": "A held-out split of --dataset; default: --eval_fraction."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of the data held out for eval."})
    dataset_format: str = field(default="auto", metadata={
        "help": "auto (from each source's columns), text, prompt_completion, messages (chat, via the chat "
                "template), alpaca (instruction, input, output) or sharegpt (conversations of from/value)."})
    chat_template: str = field(default="", metadata={
        "help": "A Jinja chat template file, or a bundled name (llama3, chatml), for a tokenizer without one or "
                "to replace its own."})
    dataset_num_proc: int | None = field(default=None, metadata={
        "help": "Processes that tokenize the data (once per node; default: up to 8, one per spare CPU core)."})
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
    warmup_ratio: float = field(default=0.03, metadata={"help": "Share of the optimizer steps spent warming up."})
    warmup_steps: int = field(default=0, metadata={
        "help": "Warm-up optimizer steps, instead of --warmup_ratio (given alone on the command line, it sets the "
                "recipe's --warmup_ratio to 0); 0 = use --warmup_ratio."})
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
    save_dtype: str = field(default="auto", metadata={
        "help": "dtype of the final Hugging Face export: auto (the model's own, config.json's dtype: bf16 for "
                "the Llama recipes), bf16, fp16 or fp32."})
    generation_samples: int = field(default=4, metadata={
        "help": "At each eval, greedily answer this many held-out prompts (samples.jsonl, a W&B table); 0 = off."})
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
    dry_run: bool = field(default=False, metadata={
        "help": "Check the recipe and print its memory plan for --hardware, then exit (no data, model or output "
                "dir is touched). Under accelerate launch it plans the launched config; run alone it plans "
                "--config_file, or the config in the recipe's launch line."})
    config_file: str = field(default="", metadata={
        "help": "With --dry_run outside accelerate launch: the accelerate config YAML to plan."})
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

    def warmup_steps_for(self, max_steps: int) -> int:
        """The scheduler's warm-up steps: --warmup_steps, else --warmup_ratio of the run's optimizer steps."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * max_steps)


@dataclass(frozen=True)
class BatchPlan:
    """global_batch_size = per_device_train_batch_size x gradient_accumulation_steps x data-parallel size."""

    micro_batch: int
    accumulation: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size


def check_nvme_path(recipe: Recipe, nvme_offloaded: Sequence[str]) -> None:
    """NVMe offload needs --offload_nvme_path, and the flag needs NVMe offload: accelerate launch does not pass a
    YAML's nvme paths to the script, so DeepSpeed would write its swap files to ./none; the shipped JSON's
    nvme_path is "auto", which accelerate fills from the path the trainer sets. `nvme_offloaded`: the states the
    launch offloads to NVMe without a directory of their own (shardtune.launch.LaunchDescription.nvme_offloaded)."""
    path = recipe.offload_nvme_path
    if nvme_offloaded and not path:
        raise ConfigError(f"The accelerate config offloads the {' and '.join(nvme_offloaded)} states to NVMe: pass "
                          "--offload_nvme_path <directory on a local NVMe disk>.")
    if path and not nvme_offloaded:
        raise ConfigError("--offload_nvme_path is used only with NVMe offload (ds_zero3_nvme_offload.yaml): drop it "
                          "or launch with that config.")
    if path and not os.path.isdir(path):
        raise ConfigError(f"--offload_nvme_path {path!r} is not a directory: create it on a local NVMe disk.")


class RecipeParser(HfArgumentParser):
    """argparse's own errors (a bad value such as `--packing maybe`) as ConfigError: one line, exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"Bad command line: {message.rstrip('.')}; see --help for the recipe's flags.")


# transformers.TrainingArguments' spellings that map onto the recipe's own flags: parsed, never Recipe fields.
ALIASES = {
    "--bf16": "TrainingArguments' spelling of --mixed_precision bf16 (false: fp32 unless --fp16 true).",
    "--fp16": "TrainingArguments' spelling of --mixed_precision fp16 (false: fp32 unless --bf16 true).",
    "--gradient_checkpointing_kwargs": 'TrainingArguments\' spelling; only \'{"use_reentrant": false}\' maps: the '
                                       "trainer always recomputes non-reentrantly.",
}


def parse_recipe(recipe: Recipe, argv: list[str] | None = None) -> Recipe:
    """Apply command-line overrides (`--learning_rate 2e-5`, `--gradient_checkpointing false`) to a recipe.
    Raises ConfigError naming every flag problem."""
    overridden, problems = parse_flags(recipe, argv)
    if problems:
        raise ConfigError(problems)
    return overridden


def parse_flags(recipe: Recipe, argv: list[str] | None = None) -> tuple[Recipe, list[str]]:
    """The recipe with the command line applied, and the flags' problems (unknown or conflicting flags), one
    message each, so that the recipe's other checks still run. A value argparse cannot read raises at once."""
    parser = RecipeParser(Recipe)
    parser.allow_abbrev = False  # a typo such as --learning_rat must not pass as --learning_rate
    group = parser.add_argument_group("TrainingArguments spellings")
    for flag in ("--bf16", "--fp16"):  # as HfArgumentParser reads a bool field: `--bf16` alone means true
        group.add_argument(flag, type=string_to_bool, nargs="?", const=True, default=None, metavar="true|false",
                           help=ALIASES[flag])
    group.add_argument("--gradient_checkpointing_kwargs", default=None, metavar="JSON",
                       help=ALIASES["--gradient_checkpointing_kwargs"])
    parser.set_defaults(**dataclasses.asdict(recipe))
    args = sys.argv[1:] if argv is None else argv
    overridden, aliases, unknown = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
    problems = unknown_argument_problems(unknown)
    for apply in (apply_precision_alias, apply_warmup_steps, check_checkpointing_kwargs):
        try:
            overridden = apply(overridden, aliases, args) or overridden
        except ConfigError as error:
            problems.extend(error.messages)
    return overridden, problems


def given(args: Sequence[str], flag: str) -> bool:
    """Whether `flag` is on the command line (abbreviations are off, so only its exact spelling counts)."""
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in args)


def unknown_argument_problems(unknown: Sequence[str]) -> list[str]:
    """One message per flag the recipe does not know, naming the nearest known flag; a value that follows an
    unknown flag is its value, not a problem of its own."""
    known = [f"--{item.name}" for item in dataclasses.fields(Recipe)] + list(ALIASES)
    problems, after_flag = [], False
    for token in unknown:
        if token.startswith("--") or (token.startswith("-") and not token[1:2].isdigit()):
            flag = token.split("=", 1)[0]
            nearest = difflib.get_close_matches(flag, known, n=1)
            hint = f"did you mean {nearest[0]}?" if nearest else "see --help for the recipe's flags."
            problems.append(f"Unknown argument {flag}: {hint}")
            after_flag = "=" not in token
        elif after_flag:
            after_flag = False
        else:
            problems.append(f"Unexpected value {token!r} on the command line: every value follows its flag "
                            "(--name value); see --help.")
    return problems


def apply_precision_alias(recipe: Recipe, aliases: argparse.Namespace, args: Sequence[str]) -> Recipe | None:
    """--bf16 / --fp16 as --mixed_precision. False switches off only the precision it names, as in TrainingArguments
    (whose default is fp32). An explicit --mixed_precision that disagrees is an error, not a silent override."""
    bf16, fp16 = aliases.bf16, aliases.fp16
    if bf16 is None and fp16 is None:
        return None
    spelled = " ".join(f"{flag} {str(value).lower()}" for flag, value in (("--bf16", bf16), ("--fp16", fp16))
                       if value is not None)
    if bf16 and fp16:
        raise ConfigError(f"{spelled} ask for two precisions at once: give one, or --mixed_precision bf16, fp16 "
                          "or no.")
    current = recipe.mixed_precision
    if bf16 or fp16:
        wanted = "bf16" if bf16 else "fp16"
    else:
        switched_off = {name for name, value in (("bf16", bf16), ("fp16", fp16)) if value is False}
        wanted = "no" if current in switched_off else current
    if wanted != current and given(args, "--mixed_precision"):
        raise ConfigError(f"{spelled} asks for {wanted}, --mixed_precision for {current}: give only one of them.")
    return dataclasses.replace(recipe, mixed_precision=wanted)


def apply_warmup_steps(recipe: Recipe, aliases: argparse.Namespace, args: Sequence[str]) -> Recipe | None:
    """`--warmup_steps N` alone on the command line replaces the recipe's warm-up ratio; both given is an error
    (check_warmup), as it would be ambiguous which one the scheduler follows."""
    if recipe.warmup_steps > 0 and given(args, "--warmup_steps") and not given(args, "--warmup_ratio"):
        return dataclasses.replace(recipe, warmup_ratio=0.0)
    return None


def check_checkpointing_kwargs(recipe: Recipe, aliases: argparse.Namespace, args: Sequence[str]) -> None:
    """TrainingArguments' --gradient_checkpointing_kwargs: the trainer always passes use_reentrant=False, so that
    is the one setting that maps; anything else would be silently ignored, so it is refused."""
    text = aliases.gradient_checkpointing_kwargs
    if text is None:
        return
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--gradient_checkpointing_kwargs {text!r} is not a JSON object: give "
                          '\'{"use_reentrant": false}\' or leave it out.')
    if kwargs.get("use_reentrant", False) is not False:
        raise ConfigError("--gradient_checkpointing_kwargs use_reentrant true is not supported: the trainer recomputes "
                          "with use_reentrant=False, PyTorch's recommended variant (the reentrant one gives no "
                          "gradients when a layer's inputs need none, as with LoRA on a frozen base). Drop it.")
    others = sorted(set(kwargs) - {"use_reentrant"})
    if others:
        raise ConfigError(f"--gradient_checkpointing_kwargs {', '.join(others)}: only use_reentrant (false) maps "
                          "onto this trainer; drop the others.")


CHAT_TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")


def dataset_sources(dataset: str) -> list[str]:
    """--dataset's sources: one, or several separated by commas (a mixture)."""
    return [source.strip() for source in dataset.split(",")]


def dataset_weights(recipe: Recipe) -> list[float]:
    """The share of each source's rows to take (1.0 = all of it). Raises ConfigError on a bad --dataset_weights."""
    count = len(dataset_sources(recipe.dataset))
    if not recipe.dataset_weights.strip():
        return [1.0] * count
    texts = [text.strip() for text in recipe.dataset_weights.split(",")]
    if len(texts) != count:
        raise ConfigError(f"--dataset_weights gives {len(texts)} weight(s) for {count} --dataset source(s): give one "
                          "share per source, in the same order (e.g. --dataset_weights 1.0,0.5).")
    weights = []
    for text in texts:
        try:
            weight = float(text)
        except ValueError:
            weight = float("nan")
        if not 0.0 < weight <= 1.0:  # also NaN and infinities
            raise ConfigError(f"--dataset_weights {text!r} is not a share of a source's rows: give a number above 0 "
                              "and at most 1 (1.0 = all rows, 0.5 = half).")
        weights.append(weight)
    return weights


def check_dataset_sources(recipe: Recipe) -> None:
    """Every --dataset source (comma-separated) is a usable path or a Hub name."""
    for source in dataset_sources(recipe.dataset):
        if not source:
            raise ConfigError(f"--dataset {recipe.dataset!r} has an empty source between commas: separate the "
                              "sources with single commas.")
        check_dataset_path(source)


def check_dataset_weights(recipe: Recipe) -> None:
    dataset_weights(recipe)


def check_dataset_num_proc(recipe: Recipe) -> None:
    if recipe.dataset_num_proc is not None and recipe.dataset_num_proc < 1:
        raise ConfigError(f"--dataset_num_proc must be >= 1, got {recipe.dataset_num_proc}; leave it unset for the "
                          "default (up to 8 processes).")


def bundled_chat_templates() -> list[str]:
    """Names of the chat templates shipped in shardtune/chat_templates (`<name>.jinja`)."""
    names = os.listdir(CHAT_TEMPLATES_DIR) if os.path.isdir(CHAT_TEMPLATES_DIR) else []
    return sorted(name[: -len(".jinja")] for name in names if name.endswith(".jinja"))


def chat_template_path(value: str) -> str:
    """The Jinja file of --chat_template: a file path, else a bundled name. Raises ConfigError for neither."""
    if os.path.isfile(value):
        return value
    if value in bundled_chat_templates():
        return os.path.join(CHAT_TEMPLATES_DIR, f"{value}.jinja")
    raise ConfigError(f"--chat_template {value!r} is neither a Jinja file nor a bundled template: give a file path "
                      f"or one of {', '.join(bundled_chat_templates())}.")


def check_chat_template(recipe: Recipe) -> None:
    if recipe.chat_template:
        chat_template_path(recipe.chat_template)


def check_dataset_path(dataset: str) -> None:
    """A local file of a known type or a `save_to_disk` directory; anything that does not look like a path is taken
    as a Hub dataset name (checked when it loads)."""
    suffix = os.path.splitext(dataset)[1].lower()
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
    elif looks_like_path(dataset):
        raise ConfigError(f"Dataset file not found: {dataset!r}. Check the path given to --dataset.")


def looks_like_path(name: str) -> bool:
    """A name that has a file extension (`train.jsonl`, not `Qwen2.5-7B`'s `.5-7B`) or cannot be a Hub repo id
    (`./x`, `/x`, `~/x`, `a/b/c`, `data/`): what exists nowhere locally is then "not found", not a Hub name."""
    if re.fullmatch(r"\.[A-Za-z][A-Za-z0-9]*", os.path.splitext(name)[1]):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


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
    for flag, value, choices in (("--dataset_format", recipe.dataset_format, DATASET_FORMATS),
                                 ("--truncation", recipe.truncation, ("truncate", "drop")),
                                 ("--mixed_precision", recipe.mixed_precision, MIXED_PRECISIONS),
                                 ("--lr_scheduler_type", recipe.lr_scheduler_type, LR_SCHEDULERS),
                                 ("--report_to", recipe.report_to, ("wandb", "none"))):
        problems.check(check_choice, flag, value, choices)
    problems.raise_any()


def check_quantization(recipe: Recipe, on_gpu: bool) -> None:
    """QLoRA's prerequisites, in the order a user meets them (each later one matters only once the earlier holds)."""
    if recipe.load_in_4bit and not recipe.use_peft:
        raise ConfigError("--load_in_4bit true quantizes the frozen base for QLoRA: add --use_peft true.")
    if recipe.load_in_4bit and not on_gpu:
        raise ConfigError("--load_in_4bit needs a CUDA GPU: bitsandbytes' 4-bit kernels do not run on this machine. "
                          "Use --use_peft true without --load_in_4bit (LoRA on a 16-bit base).")
    if recipe.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--load_in_4bit needs bitsandbytes: pip install bitsandbytes")


def check_lora(recipe: Recipe) -> None:
    if recipe.use_peft and (recipe.lora_r < 1 or recipe.lora_alpha < 1 or not 0 <= recipe.lora_dropout < 1):
        raise ConfigError(f"LoRA needs --lora_r >= 1, --lora_alpha >= 1 and 0 <= --lora_dropout < 1; got "
                          f"{recipe.lora_r}, {recipe.lora_alpha} and {recipe.lora_dropout}.")


def check_loss_scaler(recipe: Recipe, on_gpu: bool, uses_deepspeed: bool) -> None:
    if recipe.mixed_precision == "fp16" and not (on_gpu or uses_deepspeed):
        raise ConfigError(
            "--mixed_precision fp16 needs a loss scaler, and accelerate has none without a GPU: fp16 would train "
            "unscaled (or silently in fp32). Use --mixed_precision bf16 or no."
        )


def check_at_least(flag: str, value: float, lowest: float) -> None:
    if value < lowest:
        raise ConfigError(f"{flag} must be >= {lowest}, got {value}.")


def check_numbers(recipe: Recipe) -> None:
    """Hyper-parameters, step counts and timeouts within their ranges; every one out of range is reported."""
    problems = Problems()
    if not 0.0 < recipe.eval_fraction < 1.0:
        problems.messages.append(f"--eval_fraction must be between 0 and 1 (exclusive), got {recipe.eval_fraction}.")
    if not recipe.learning_rate > 0:  # also NaN
        problems.messages.append(f"--learning_rate must be > 0, got {recipe.learning_rate}: give e.g. "
                                 "--learning_rate 1e-5.")
    if recipe.max_steps <= 0 and recipe.num_train_epochs <= 0:
        problems.messages.append("Nothing to train: set --max_steps > 0 or --num_train_epochs > 0.")
    for flag, value, lowest in (("--max_seq_length", recipe.max_seq_length, 2),  # a token and one to predict
                                ("--per_device_eval_batch_size", recipe.per_device_eval_batch_size, 1),
                                ("--gradient_checkpointing_interval", recipe.gradient_checkpointing_interval, 1),
                                ("--logging_steps", recipe.logging_steps, 1),
                                ("--eval_steps", recipe.eval_steps, 0),
                                ("--save_steps", recipe.save_steps, 0),
                                ("--save_total_limit", recipe.save_total_limit, 0)):
        problems.check(check_at_least, flag, value, lowest)
    for name in ("collective_timeout_minutes", "startup_timeout_minutes", "rank_timeout_s"):
        if not getattr(recipe, name) > 0:
            problems.messages.append(f"--{name} must be > 0, got {getattr(recipe, name)}.")
    problems.check(check_warmup, recipe)
    problems.raise_any()


def check_warmup(recipe: Recipe) -> None:
    if not 0.0 <= recipe.warmup_ratio <= 1.0:
        raise ConfigError(f"--warmup_ratio is the share of steps spent warming up: between 0 and 1, got "
                          f"{recipe.warmup_ratio}.")
    if recipe.warmup_steps < 0:
        raise ConfigError(f"--warmup_steps must be >= 0, got {recipe.warmup_steps}.")
    if recipe.warmup_steps > 0 and recipe.warmup_ratio > 0:
        raise ConfigError(f"--warmup_steps {recipe.warmup_steps} and --warmup_ratio {recipe.warmup_ratio} both set "
                          "the warm-up: give one of them (--warmup_ratio 0 to count in steps).")


def check_tracking(recipe: Recipe) -> None:
    if recipe.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--report_to wandb needs wandb, which is not installed: pip install wandb, or pass "
                          "--report_to none.")


def check_checkpoints(recipe: Recipe) -> None:
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


def check_output_dir(recipe: Recipe) -> None:
    output_dir = recipe.resolved_output_dir
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"--output_dir {output_dir!r} is a file; give a directory.")
    occupied = os.path.isdir(output_dir) and any(not name.startswith(".") for name in os.listdir(output_dir))
    if occupied and not (recipe.resume_from_checkpoint or recipe.overwrite_output_dir):
        raise ConfigError(
            f"--output_dir {output_dir!r} already holds files of another run. Resume it with "
            "--resume_from_checkpoint auto, replace it with --overwrite_output_dir true, or pick another directory."
        )


def check_exports(recipe: Recipe) -> None:
    problems = []
    if recipe.generation_samples < 0:
        problems.append(f"--generation_samples must be 0 (off) or a positive count of held-out prompts to answer at "
                        f"each eval; got {recipe.generation_samples}.")
    if recipe.save_dtype not in SAVE_DTYPES:
        problems.append(f"--save_dtype {recipe.save_dtype!r} is not one of {', '.join(SAVE_DTYPES)} (auto: the dtype "
                        "the model's config.json states).")
    if problems:
        raise ConfigError(problems)


# Checks that need the recipe alone: no model, no data read, no launch environment. Each raises ConfigError (with
# one message or several); all of them run and every failure is reported together. A new check goes here.
RECIPE_CHECKS: tuple[Callable[[Recipe], None], ...] = (
    check_inputs_named,
    check_dataset_weights,
    check_dataset_num_proc,
    check_chat_template,
    check_choices,
    check_lora,
    check_numbers,
    check_tracking,
    check_checkpoints,
    check_exports,
    check_output_dir,
)


def check_recipe(recipe: Recipe, problems: Problems, has_gpu: bool,
                 launch: tuple[int, bool] | None, nvme_offloaded: Sequence[str]) -> BatchPlan | None:
    """Run every check that needs no model and no data loaded, recording failures in `problems`. `has_gpu`: CUDA
    is available; `launch`: (world size, DeepSpeed?), None when the launch environment failed its own checks (the
    checks that depend on it are then skipped); `nvme_offloaded`: the launch's states offloaded to NVMe that take
    --offload_nvme_path. Returns the batch plan, or None if it could not be made."""
    problems.check(check_device, recipe, has_gpu)
    on_gpu = has_gpu and not recipe.use_cpu
    problems.check(check_attention, recipe, on_gpu)
    problems.check(check_quantization, recipe, on_gpu)
    for check in RECIPE_CHECKS:
        problems.check(check, recipe)
    if launch is None:
        return None
    world_size, uses_deepspeed = launch
    problems.check(check_loss_scaler, recipe, on_gpu, uses_deepspeed)
    problems.check(check_nvme_path, recipe, nvme_offloaded)
    return problems.check(plan_batches, recipe, world_size)


def validate(recipe: Recipe, world_size: int, uses_deepspeed: bool, has_gpu: bool,
             nvme_offloaded: Sequence[str]) -> BatchPlan:
    """Every check that needs no model and no data loaded. `has_gpu`: CUDA is available; `nvme_offloaded` as in
    check_recipe. Raises one ConfigError with every failure."""
    problems = Problems()
    plan = check_recipe(recipe, problems, has_gpu, (world_size, uses_deepspeed), nvme_offloaded)
    problems.raise_any()
    assert plan is not None  # no problems: plan_batches returned
    return plan

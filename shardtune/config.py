"""The recipe: every value a run needs and the choices and ranges they take, the batch arithmetic, and the error
that refuses a run. Flags are read in shardtune.flags, values checked in shardtune.checks.startup."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from shardtune.models.families import LIGER_MODEL_TYPES  # noqa: F401 (its home is the families' table)

MIXED_PRECISIONS = ("bf16", "fp16", "no", "fp8")
# --mixed_precision fp8 (shardtune.levers.float8): the decoder layers' linears in float8, everything else as under bf16.
FP8_COMPUTE_PRECISION = "bf16"
FP8_MIN_CAPABILITY = (8, 9)  # torch._scaled_mm's float8 tensor cores: Ada (8.9), Hopper (9.0) and later
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of a float8 operand divisible by 16
DATASET_FORMATS = ("auto", "text", "prompt_completion", "messages", "alpaca", "sharegpt", "preference")
# --method: supervised fine-tuning, or direct preference optimisation on prompt/chosen/rejected pairs (TRL's DPO).
METHODS = ("sft", "dpo")
# DPO's reference, held one of three ways (shardtune.methods.reference): the base with the LoRA adapter off, log-probs
# precomputed before training, or a live frozen copy.
REFERENCE_MODES = ("adapter", "precomputed", "live")
# --loss_type: TRL 1.16 DPOTrainer's pairwise losses (shardtune.methods.dpo_loss computes each as TRL does).
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "sigmoid_norm", "sft")
DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# transformers' schedulers that need neither extra arguments nor a metric at every step (the trainer gives neither).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")
ZERO_STAGES = ("1", "2", "3")
# --optim's names, transformers' TrainingArguments' (shardtune.levers.optimizers builds them).
TORCH_OPTIMIZERS = ("adamw_torch",)
TORCHAO_OPTIMIZERS = ("adamw_torch_8bit", "adamw_torch_4bit")
BITSANDBYTES_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")
OPTIMIZERS = (*TORCH_OPTIMIZERS, *TORCHAO_OPTIMIZERS, *BITSANDBYTES_OPTIMIZERS)
# The package each optimizer needs beyond torch, as pip installs it (--bf16_stochastic_round: torchao for all).
OPTIMIZER_PACKAGES = {**dict.fromkeys(TORCHAO_OPTIMIZERS, "torchao"),
                      **dict.fromkeys(BITSANDBYTES_OPTIMIZERS, "bitsandbytes")}
TORCHAO_VERSION = "0.18.0"  # requirements.txt's pin
# transformers' Trainer passes block_size 256 to AdamW8bit and AdamW4bit alike (its optim_args default).
TORCHAO_BLOCK_SIZE = 256
# --use_liger_kernel: the pinned Liger (requirements.txt), and the model types whose layers levers.liger patches
# (Liger's apply_liger_kernel_to_llama, _mistral and _qwen2: the families the recipes train).
LIGER_VERSION = "0.8.5"
# transformers' attention implementations for training, and the package each needs beyond torch.
ATTENTION_PACKAGES = {"sdpa": None, "eager": None, "flex_attention": None, "flash_attention_2": "flash_attn",
                      "flash_attention_3": "flash_attn_interface"}
# --packing_strategy: padding_free flattens each micro-batch as it comes (TRL's `padding_free`); bfd first packs the
# sequences into full rows, best-fit decreasing (TRL's `packing_strategy="bfd"`), then flattens those.
PACKING_STRATEGIES = ("padding_free", "bfd")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
SAVE_DTYPES = ("auto", "bf16", "fp16", "fp32")
CHECKPOINTING_MODES = ("full", "selective")
# torch.compile's modes that training can take: reduce-overhead and max-autotune capture CUDA graphs, which replay
# fixed shapes and addresses (a varying sequence length re-records them; FSDP2's and ZeRO-3's gathers move weights).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# The Recipe fields that take one of a fixed set of values: the recipe's checks and the planner's flags read this.
FIELD_CHOICES = {"method": METHODS, "dataset_format": DATASET_FORMATS, "truncation": ("truncate", "drop"),
                 "mixed_precision": MIXED_PRECISIONS, "lr_scheduler_type": LR_SCHEDULERS, "optim": OPTIMIZERS,
                 "report_to": ("wandb", "none"), "gradient_checkpointing_mode": CHECKPOINTING_MODES,
                 "attn_implementation": tuple(ATTENTION_PACKAGES), "packing_strategy": PACKING_STRATEGIES}
# How the memory planner models each of them (the same names, in the planner CLI's order): SDPA and eager take a
# dense mask; the flash kernels (flash-attn's varlen kernels, flex attention's block mask) none.
PLANNED_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash", "flash_attention_3": "flash",
                     "flex_attention": "flash"}
# Why --activation_offloading needs every decoder layer recomputed (the recipe's check and the planner say it).
OFFLOADING_NEEDS_RECOMPUTATION = (
    "--activation_offloading copies what the forward saves for backward to host memory, and a layer that is not "
    "recomputed saves its weights for backward too (gathered under FSDP and ZeRO-3, cast under autocast), which "
    "would be copied every step: add --gradient_checkpointing true with --gradient_checkpointing_interval 1 "
    "(full or selective), or drop --activation_offloading.")
OFFLOADING_UNDER_DEEPSPEED_OFFLOAD = (
    "--activation_offloading with DeepSpeed's offload_optimizer or offload_param: those runs cap torch's pinned-memory "
    "cache at 1 MB so that DeepSpeed's pinned buffers are not rounded up to powers of two, and every offloaded "
    "activation would then be pinned and unpinned anew each micro-batch: drop one of the two.")
# Positions of the eval's logits upcast to fp32 at once (shardtune.evaluation), as the planner counts them.
EVAL_CHUNK_POSITIONS = 1024
# Positions per tile of the training loss with --chunked_cross_entropy (shardtune.levers.tiled_loss), as the planner
# counts them: a tile's fp32 logits are 4 x 1024 x vocab bytes (0.5 GB for Llama 3's 128,256 tokens).
LOSS_TILE_POSITIONS = 1024
# The smallest value of each counting flag: the recipe's checks and the planner's command line read this one table.
LOWEST_VALUES = {
    "--max_seq_length": 2,  # a token and one to predict
    "--per_device_train_batch_size": 1,
    "--per_device_eval_batch_size": 1,
    "--global_batch_size": 1,
    "--gradient_accumulation_steps": 1,
    "--gradient_checkpointing_interval": 1,
    "--lora_r": 1,
    "--logging_steps": 1,
    "--eval_steps": 0,  # 0: only at the end
    "--save_steps": 0,  # 0: never
    "--save_total_limit": 0,  # 0: keep all
    "--pad_to_multiple_of": 1,
}


def compute_precision(mixed_precision: str) -> str:
    """The precision accelerate, FSDP2's policy and the loaded weights take for --mixed_precision: fp8's is bf16
    (its float8 linears cast their own operands)."""
    return FP8_COMPUTE_PRECISION if mixed_precision == "fp8" else mixed_precision


def reference_mode(method: str, use_peft: bool, precompute_ref_log_probs: bool, ref_model_name_or_path: str
                   ) -> str | None:
    """The REFERENCE_MODES entry a run holds (the trainer and the planner ask this one function); None for SFT."""
    if method != "dpo":
        return None
    if precompute_ref_log_probs:
        return "precomputed"
    return "adapter" if use_peft and not ref_model_name_or_path else "live"


def token_multiple(recipe: Recipe) -> int:
    """What each micro-batch's length (its packed row's, with --packing) is padded to a multiple of:
    --pad_to_multiple_of, else FP8_DIM_MULTIPLE under fp8 (the tokens are the inner dimension of each float8
    weight-gradient matmul, which torch._scaled_mm takes in multiples of 16 on the GPU), else 1 (no padding)."""
    return recipe.pad_to_multiple_of or (FP8_DIM_MULTIPLE if recipe.mixed_precision == "fp8" else 1)


def padded_length(recipe: Recipe) -> int:
    """The longest micro-batch row: --max_seq_length rounded up to token_multiple (what the planner plans)."""
    return -(-recipe.max_seq_length // token_multiple(recipe)) * token_multiple(recipe)


def below_lowest(values: Iterable[tuple[str, float | None]]) -> list[str]:
    """One message per (flag, value) below the flag's LOWEST_VALUES entry, in the order given; None (a flag not
    given) passes."""
    return [f"{flag} must be >= {LOWEST_VALUES[flag]}, got {value}." for flag, value in values
            if value is not None and value < LOWEST_VALUES[flag]]


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
    method: str = field(default="sft", metadata={
        "help": "sft (supervised fine-tuning) or dpo (direct preference optimisation on prompt/chosen/rejected "
                "pairs, as TRL's DPOTrainer; see --beta, --loss_type and the reference flags)."})
    model_name_or_path: str = field(default="", metadata={"help": "Hub model id or local model directory."})
    dataset: str = field(default="", metadata={
        "help": "A local .json/.jsonl/.parquet/.csv file, a `save_to_disk` directory, or a Hub dataset name; "
                "several, separated by commas, are mixed (see --dataset_weights)."})
    dataset_weights: str = field(default="", metadata={
        "help": "With several --dataset sources: the share of each source's rows to take, comma-separated "
                "(1.0 = all of it, 0.5 = half, drawn with --seed); empty = all of every source."})
    dataset_split: str = field(default="train", metadata={"help": "The split of each --dataset source to train on."})
    eval_split: str = field(default="", metadata={
        "help": "A held-out split of --dataset; empty = hold out --eval_fraction."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of the data held out for eval."})
    dataset_format: str = field(default="auto", metadata={
        "help": "auto (from each source's columns), text, prompt_completion, messages (chat, via the chat "
                "template), alpaca (instruction, input, output), sharegpt (conversations of from/value) or "
                "preference (chosen and rejected, with or without prompt: --method dpo)."})
    chat_template: str = field(default="", metadata={
        "help": "A Jinja chat template file, or a bundled name (llama3, chatml), for a tokenizer without one or "
                "to replace its own."})
    dataset_num_proc: int | None = field(default=None, metadata={
        "help": "Processes that tokenize the data (once per node; unset = up to 8, one per spare CPU core)."})
    completion_only_loss: bool = field(default=True, metadata={
        "help": "Loss on completion / assistant tokens only; false: on every token."})
    truncation: str = field(default="truncate", metadata={"help": "Rows over --max_seq_length: truncate or drop."})
    packing: bool = field(default=False, metadata={
        "help": "Padding-free: each micro-batch is one row of its sequences, attention isolated per sequence."})
    packing_strategy: str = field(default="padding_free", metadata={
        "help": "With --packing: padding_free (each micro-batch's sequences as they come) or bfd (the sequences "
                "first bin-packed, best-fit decreasing, into rows of --max_seq_length tokens, so that a micro-batch "
                "of 1 holds a full row; batch sizes then count rows)."})
    pad_to_multiple_of: int | None = field(default=None, metadata={
        "help": "Pad each micro-batch's length (its packed row's, with --packing) up to a multiple of this; the "
                "padding carries no loss. Fewer distinct shapes for --torch_compile. Unset: no padding, or 16 under "
                "--mixed_precision fp8 (float8 matmuls take the tokens in multiples of 16)."})
    beta: float = field(default=0.1, metadata={
        "help": "--method dpo: how far the policy may move from the reference (the KL weight; IPO's tau)."})
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"], metadata={
        "help": f"--method dpo: one or several of {', '.join(DPO_LOSS_TYPES)}, space-separated (sigmoid sft = "
                "RPO), summed with --loss_weights."})
    loss_weights: list[float] | None = field(default=None, metadata={
        "help": "--method dpo: one weight per --loss_type; unset = 1 each."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "--method dpo: the share of pairs taken as mislabelled (robust in [0, 0.5), exo_pair in (0, 1))."})
    precompute_ref_log_probs: bool = field(default=False, metadata={
        "help": "--method dpo: the reference's log-probs in one pass before training (cached in the output dir), "
                "so that no reference model is held while training."})
    ref_model_name_or_path: str = field(default="", metadata={
        "help": "--method dpo: the reference model; empty = --model_name_or_path (under --use_peft: the base with "
                "the adapter switched off)."})
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters; the base stays frozen."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank: the inner dimension of each adapter."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling: the adapters' update is scaled by "
                                                            "lora_alpha / lora_r."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA adapters' input."})
    lora_target_modules: str = field(default="all-linear", metadata={
        "help": "all-linear, or comma-separated module names (q_proj,v_proj)."})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA: the frozen base in 4-bit NF4 (bitsandbytes, CUDA GPUs); needs --use_peft."})
    output_dir: str = field(default="", metadata={"help": "Where metrics, W&B files and the model go."})
    max_seq_length: int = field(default=2048, metadata={
        "help": "Tokens per sequence at most (see --truncation); with --packing_strategy bfd, tokens per packed "
                "row (padding-free packing joins a micro-batch's sequences: up to micro-batch x this)."})
    per_device_train_batch_size: int = field(default=1, metadata={
        "help": "The batch size per device for training: sequences in one micro-batch (packed rows with "
                "--packing_strategy bfd)."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "The batch size per device for evaluation."})
    global_batch_size: int | None = field(
        default=None, metadata={"help": "Sequences (packed rows with --packing_strategy bfd) per optimizer step over "
                                      "all ranks; accumulation is derived."}
    )
    gradient_accumulation_steps: int | None = field(
        default=None, metadata={"help": "Micro-batches per optimizer step; must agree with --global_batch_size."}
    )
    optim: str = field(default="adamw_torch", metadata={
        "help": "TrainingArguments' names: adamw_torch (fused on CUDA); adamw_torch_8bit or adamw_torch_4bit "
                "(torchao: Adam's states in 8 or 4 bits per block of 256; CPU, DDP, FSDP2); adamw_8bit or "
                "paged_adamw_8bit (bitsandbytes: CUDA, DDP). DeepSpeed takes adamw_torch only."})
    bf16_stochastic_round: bool = field(default=False, metadata={
        "help": "Trades the fp32 master copy for memory: the weights and gradients are held in bf16 (no fp32 "
                "copy anywhere) and torchao's AdamW rounds each update to bf16 stochastically (torchao's "
                "bf16_stochastic_round, TrainingArguments' optim_args key), with --optim adamw_torch (bf16 states), "
                "adamw_torch_8bit or adamw_torch_4bit. Needs --mixed_precision bf16; FSDP2 or one process."})
    learning_rate: float = field(default=1e-5, metadata={"help": "The initial learning rate for AdamW."})
    weight_decay: float = field(default=0.0, metadata={
        "help": "AdamW's weight decay coefficient, on matrices only (not on norms and biases)."})
    adam_beta1: float = field(default=0.9, metadata={
        "help": "The exponential decay rate for the first moment estimates (momentum) in AdamW."})
    adam_beta2: float = field(default=0.95, metadata={
        "help": "The exponential decay rate for the second moment estimates (variance) in AdamW."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "Epsilon value for numerical stability in AdamW."})
    max_grad_norm: float = field(default=1.0, metadata={
        "help": "Maximum gradient norm: gradients are clipped to it before each optimizer step; 0 clips nothing (the "
                "norm is still logged)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": f"One of {', '.join(LR_SCHEDULERS)}."})
    lr_scheduler_kwargs: str = field(default="", metadata={
        "help": "The schedule's own arguments, a JSON object, as TrainingArguments' lr_scheduler_kwargs: e.g. "
                '\'{"num_cycles": 3}\' for cosine_with_restarts, \'{"lr_end": 1e-6, "power": 2.0}\' for polynomial.'})
    warmup_ratio: float = field(default=0.03, metadata={"help": "Share of the optimizer steps spent warming up."})
    warmup_steps: int = field(default=0, metadata={
        "help": "Warm-up optimizer steps, instead of --warmup_ratio (given alone on the command line, it sets the "
                "recipe's --warmup_ratio to 0); 0 = use --warmup_ratio."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1 means num_train_epochs."})
    num_train_epochs: int = field(default=1, metadata={
        "help": "Total number of training epochs to perform (when --max_steps is -1)."})
    gradient_checkpointing: bool = field(default=True, metadata={
        "help": "Recompute activations in the backward pass instead of keeping them: less memory, more compute."})
    gradient_checkpointing_interval: int = field(
        default=1, metadata={"help": "Recompute every k-th decoder layer (1 = all layers)."}
    )
    gradient_checkpointing_mode: str = field(default="full", metadata={
        "help": "full: recompute each checkpointed layer whole; selective: keep its attention output and every "
                "other matmul's output (torchtitan's op-level policy), recompute the rest: more memory, less "
                "recompute."})
    activation_offloading: bool = field(default=False, metadata={
        "help": "Move the tensors the forward saves for backward to pinned host memory and back in backward "
                "(TRL's OffloadActivations; CUDA GPUs): less GPU memory, more host RAM and PCIe traffic."})
    chunked_cross_entropy: bool = field(default=True, metadata={
        "help": f"Compute the training loss over tiles of {LOSS_TILE_POSITIONS} positions, each tile's logits "
                "recomputed in backward, so that the full fp32 logits never exist; false: the plain loss over the "
                "whole micro-batch's logits."})
    use_liger_kernel: bool = field(default=False, metadata={
        "help": "Liger's Triton kernels (CUDA GPUs): RMSNorm, SwiGLU and RoPE in each layer, and the training loss "
                "as Liger's fused linear cross-entropy inside the LM head's forward in place of the tiles of "
                "--chunked_cross_entropy (which it needs); eval keeps its own loss. Llama, Mistral and Qwen2."})
    torch_compile: bool = field(default=False, metadata={
        "help": "Compile each decoder layer with torch.compile, in place (accelerate's regional compilation: the "
                "layers share one compiled graph, so compile time does not grow with depth); the sequence length "
                "becomes dynamic after its first change, so varying batches do not recompile each step."})
    torch_compile_backend: str = field(default="inductor", metadata={
        "help": "With --torch_compile: the torch.compile backend (inductor; aot_eager traces without generating "
                "kernels)."})
    torch_compile_mode: str | None = field(default=None, metadata={
        "help": f"With --torch_compile: torch.compile's mode, one of {', '.join(COMPILE_MODES)}; unset = default. "
                "The CUDA-graph modes are refused: graphs replay fixed shapes and addresses."})
    mixed_precision: str = field(default="bf16", metadata={
        "help": "bf16, fp16 (with a loss scaler), no (fp32), or fp8: bf16 with the decoder layers' linears in float8 "
                "(torchao's float8 training, tensorwise scaling; under FSDP2 the weights are gathered in float8; "
                "lm_head stays bf16). fp8 trades precision for speed: GPUs of compute capability 8.9 or more "
                "(H100, H200, L4, L40S), full fine-tuning under FSDP2 or DDP."})
    attn_implementation: str = field(default="sdpa", metadata={
        "help": f"One of {', '.join(ATTENTION_PACKAGES)}. With --packing on a GPU: flash_attention_2 or "
                "flex_attention (SDPA and eager build a dense mask over the packed row)."})
    use_cpu: bool = field(default=False, metadata={
        "help": "Train on CPU over gloo (tests, demos). Without it a machine with no visible CUDA GPU is an error, "
                "not a silent CPU run."})
    seed: int = field(default=42, metadata={
        "help": "Random seed set at the beginning of training; also shuffles, mixes and splits the data."})
    logging_steps: int = field(default=10, metadata={"help": "Log metrics every N optimizer steps."})
    eval_steps: int = field(default=0, metadata={"help": "Eval every N steps; 0 = only at the end."})
    report_to: str = field(default="wandb", metadata={"help": "wandb or none."})
    wandb_project: str = field(default="shardtune", metadata={"help": "The W&B project the run is logged to."})
    run_name: str = field(default="", metadata={"help": "The run's name in W&B; empty = --name."})
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
        default="", metadata={"help": "`auto` (the newest complete checkpoint in output_dir; step 0 where its run "
                                      "saved none; refused where no run started) or a checkpoint's path."}
    )
    hardware: str = field(
        default="", metadata={"help": "Plan memory for this hardware at start-up (e.g. 8xh100-80gb); "
                              "empty = the GPUs found. A plan that does not fit stops the run before loading."}
    )
    dry_run: bool = field(default=False, metadata={
        "help": "Check the recipe and print its memory plan for --hardware, then exit (no data, model or output "
                "dir is touched). Under accelerate launch it plans the launched config; run alone it plans "
                "--config_file, or the config in the recipe's launch line."})
    config_file: str = field(default="", metadata={
        "help": "With --dry_run outside accelerate launch: the accelerate config YAML to plan (to train under a "
                "config, give it to accelerate launch --config_file)."})
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

    @property
    def reference_mode(self) -> str | None:
        return reference_mode(self.method, self.use_peft, self.precompute_ref_log_probs, self.ref_model_name_or_path)

    def warmup_steps_for(self, max_steps: int) -> int:
        """The scheduler's warm-up steps: --warmup_steps, else --warmup_ratio of the run's optimizer steps."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * max_steps)


@dataclass(frozen=True)
class BatchSizes:
    """global_batch_size = per_device_train_batch_size x gradient_accumulation_steps x data-parallel size, the
    processes / (tp_size x cp_size): the ranks of a tensor- or context-parallel group run the same rows."""

    micro_batch: int
    accumulation: int
    world_size: int
    tp_size: int = 1
    cp_size: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tp_size * self.cp_size)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.data_parallel_size

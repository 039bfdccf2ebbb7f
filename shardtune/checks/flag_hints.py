"""What an unknown flag most likely meant: first by meaning (the names TRL, axolotl, torchtune and transformers
give the recipe's settings), then by spelling. Flags are refused, never taken as aliases: the hint names the
recipe's own flag, so that the command line a user keeps is the one the docs and --help describe."""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import os
from collections.abc import Iterable

from shardtune.parallel.launcher_args import script_shown


def accelerate_config(engine: str, example: str, family: str) -> str:
    """The hint for a flag that picks the sharding engine, which a launch takes from its accelerate config."""
    return (f"{engine} is chosen by the accelerate config, not a recipe flag: accelerate launch --config_file "
            f"accelerate_configs/{example} recipes/<recipe>.py (the others: accelerate_configs/{family}).")


def launch_line(config_file: str) -> str:
    """How a run trains under an accelerate config: the launcher reads it, before the script (this one, when a
    recipe runs)."""
    script = script_shown()
    return f"accelerate launch --config_file {config_file} {script} ..."


def launcher_hint(flag: str, value: str | None) -> str:
    """The hint for a flag of `accelerate launch` given to the recipe: it goes before the script."""
    script = script_shown()
    given = f"{flag} {value}" if value else flag
    return (f"a flag of accelerate launch, not of the recipe: give it to the launcher, before the script: "
            f"accelerate launch --config_file accelerate_configs/<config>.yaml {given} {script} ...")


@functools.cache
def launcher_flags() -> frozenset[str]:
    """Every option of `accelerate launch`, read from accelerate's installed source without importing it (its
    import pulls in torch, seconds that a refused command line need not wait)."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    with open(os.path.join(spec.submodule_search_locations[0], "commands", "launch.py")) as file:
        tree = ast.parse(file.read())
    return frozenset(argument.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                     for argument in node.args if isinstance(argument, ast.Constant)
                     and isinstance(argument.value, str) and argument.value.startswith("--"))


# Names of an accelerate config file: the launcher's --config_file, not the recipe's (which only plans it).
CONFIG_FILE_NAMES = ("config", "config_path", "configfile", "cfg", "yaml", "config_yaml", "accelerate_config",
                     "accelerate_config_file", "launch_config")


def config_file_hint(value: str | None) -> str:
    """The hint for a flag that names an accelerate config: give it to the launcher."""
    return (f"an accelerate config is read by the launcher: {launch_line(value or 'accelerate_configs/<config>.yaml')}"
            " (a recipe's own --config_file only plans it, with --dry_run).")


# The recipe's flag, and the names other trainers give it (compared lower-case, '-' as '_'; a dotted torchtune key
# such as optimizer.lr is also looked up by its last part).
RENAMED: dict[str, tuple[str, ...]] = {
    "--model_name_or_path": ("model", "model_name", "base_model", "model_id", "model_path",
                             "pretrained_model_name_or_path"),
    "--dataset": ("dataset_name", "datasets", "data_path", "dataset_path", "train_file", "data_files", "data"),
    "--dataset_split": ("dataset_train_split", "train_split"),
    "--eval_split": ("dataset_test_split", "eval_dataset", "eval_file"),
    "--eval_fraction": ("val_set_size", "test_size", "eval_size"),
    "--optim": ("optimizer", "optimizer_type"),
    "--chat_template": ("chat_template_path",),
    "--learning_rate": ("lr", "learningrate", "base_lr", "peak_lr", "max_lr", "init_lr"),
    "--per_device_train_batch_size": ("micro_batch_size", "per_gpu_train_batch_size", "per_device_batch_size",
                                      "train_micro_batch_size_per_gpu", "micro_batch"),
    "--per_device_eval_batch_size": ("eval_batch_size", "per_gpu_eval_batch_size", "eval_micro_batch_size"),
    "--global_batch_size": ("total_batch_size", "effective_batch_size", "global_batch"),
    "--gradient_accumulation_steps": ("gradient_accumulation", "grad_accum", "grad_accumulation",
                                      "accumulate_grad_batches", "gradient_accumulation_step", "accumulation_steps"),
    "--max_seq_length": ("max_length", "sequence_len", "max_seq_len", "seq_len", "seq_length", "max_sequence_length",
                         "block_size", "model_max_length", "cutoff_len", "context_length"),
    "--num_train_epochs": ("num_epochs", "epochs", "epoch", "num_train_epoch", "train_epochs"),
    "--lr_scheduler_type": ("lr_scheduler", "scheduler", "lr_schedule", "scheduler_type"),
    "--warmup_steps": ("num_warmup_steps",),
    "--max_grad_norm": ("gradient_clipping", "clip_grad_norm", "grad_clip", "max_norm", "clip_grad"),
    "--gradient_checkpointing": ("activation_checkpointing", "enable_activation_checkpointing", "grad_checkpointing"),
    "--logging_steps": ("log_every_n_steps", "log_steps", "log_every", "log_interval"),
    "--save_steps": ("checkpointing_steps", "save_every", "save_interval", "checkpoint_every"),
    "--save_total_limit": ("save_limit", "keep_last_n_checkpoints", "max_checkpoints"),
    "--resume_from_checkpoint": ("resume", "resume_from", "resume_checkpoint"),
    "--output_dir": ("output", "out_dir", "output_path", "save_dir", "outdir"),
    "--use_peft": ("peft", "lora", "use_lora", "enable_lora"),
    "--lora_r": ("lora_rank", "lora_dim"),
    "--lora_target_modules": ("lora_target", "target_modules", "lora_modules", "lora_attn_modules"),
    "--packing": ("sample_packing", "packed", "pack", "pack_sequences", "padding_free", "packing_enabled"),
    "--attn_implementation": ("attention", "attn_impl", "attention_implementation", "attn"),
    "--run_name": ("wandb_name", "wandb_run_name", "exp_name", "experiment_name"),
    "--report_to": ("log_with", "logger", "loggers"),
    "--collective_timeout_minutes": ("ddp_timeout", "nccl_timeout"),
    "--use_cpu": ("no_cuda", "cpu"),
    "--torch_compile": ("compile", "use_torch_compile", "compile_model"),
}

# Names with no one flag of their own: what the recipe does instead.
GUIDANCE: dict[tuple[str, ...], str] = {
    ("deepspeed", "deepspeed_config", "zero_stage", "zero3"):
        accelerate_config("DeepSpeed", "ds_zero3.yaml", "ds_*.yaml"),
    ("fsdp", "fsdp_config", "fsdp_version", "fsdp_sharding_strategy"):
        accelerate_config("FSDP", "fsdp_full_shard.yaml", "fsdp_*.yaml"),
    ("torch_dtype", "dtype", "model_dtype", "precision"):
        "the training precision is --mixed_precision (bf16, fp16 or no; full fine-tuning keeps fp32 weights) and "
        "the exported model's dtype is --save_dtype.",
    ("load_in_8bit",): "8-bit loading is not supported: --use_peft true --load_in_4bit true for QLoRA, or drop it.",
    ("adapter",): "LoRA is --use_peft true (QLoRA: also --load_in_4bit true).",
    ("lora_target_linear",): "--lora_target_modules all-linear (the default).",
    ("train_on_inputs",): "--completion_only_loss false trains on prompt tokens too (true, the default, only on "
                          "completions).",
    ("assistant_only_loss",): "--completion_only_loss (true by default: loss on assistant tokens only).",
    ("batch_size", "train_batch_size"): "--per_device_train_batch_size is the micro-batch per GPU; "
                                        "--global_batch_size the sequences per optimizer step over all ranks.",
    ("eval_strategy", "evaluation_strategy", "evals_per_epoch"): "--eval_steps N evaluates every N steps "
                                                                 "(0 = only at the end).",
    ("save_strategy", "saves_per_epoch"): "--save_steps N checkpoints every N steps (0 = never).",
    ("flash_attention", "flash_attn", "use_flash_attention_2", "use_flash_attn"):
        "--attn_implementation flash_attention_2.",
    ("sdp_attention",): "--attn_implementation sdpa (the default).",
    ("warmup",): "--warmup_steps N, or --warmup_ratio R (a share of the optimizer steps).",
    ("device",): "the device follows the launch: one CUDA GPU per process, or --use_cpu true for CPU.",
    ("local_rank",): "the deepspeed launcher's flag for its script, and shardtune's runs start under accelerate "
                     "launch, which gives each rank its LOCAL_RANK itself: accelerate launch --config_file "
                     "accelerate_configs/ds_zero3.yaml (or another ds_*.yaml) recipes/<recipe>.py ...",
    ("wandb_entity", "wandb_team"): "W&B reads the entity from the environment: WANDB_ENTITY=<entity>; the project "
                                    "is --wandb_project.",
    ("wandb_mode", "wandb_offline"): "W&B reads its mode from the environment: without WANDB_API_KEY the run is "
                                     "logged offline under output_dir/wandb (wandb sync uploads it); --report_to none "
                                     "turns it off.",
    ("use_wandb", "wandb"): "--report_to wandb (the default) or --report_to none.",
    ("wandb_log_model", "log_model"): "W&B gets metrics and eval samples, not the model: the model is saved under "
                                      "output_dir (--save_model).",
    ("push_to_hub", "hub_model_id", "hub_strategy"): "a run does not push to the Hub: upload output_dir's model "
                                                     "afterwards (hf upload <repo> <output_dir>).",
}


# TrainingArguments' and TRL's flags that shardtune does not take (some from transformers 4, whose users still
# type them), their class and what shardtune does instead; the other fields of those classes (library_flags) get
# "see --help". Each is refused as theirs, never as the nearest recipe flag by spelling (--logging_dir is not
# --logging_steps).
NOT_TAKEN: dict[str, tuple[str, str]] = {
    "logging_dir": ("TrainingArguments", "metrics go to output_dir/metrics.jsonl and W&B's files under "
                                         "output_dir/wandb; --logging_steps sets how often."),
    **dict.fromkeys(("dataloader_num_workers", "dataloader_prefetch_factor", "dataloader_persistent_workers"), (
        "TrainingArguments", "the data is tokenized before training (--dataset_num_proc processes, once per node) "
                             "and micro-batches are cut from memory, with no loader workers.")),
    "dataset_text_field": ("SFTConfig", "each --dataset source's format is read from its columns: a 'text' column "
                                        "trains as plain text (--dataset_format text)."),
    "group_by_length": ("TrainingArguments", "micro-batches follow the shuffled data (--seed); --packing true removes "
                                             "the padding that grouping by length would save."),
    "save_safetensors": ("TrainingArguments", "the final model is written as safetensors (--save_model)."),
}
# The dataclasses whose fields are transformers' and TRL's flags: (module, file under the package, classes).
LIBRARY_FLAG_CLASSES = (("transformers", "training_args.py", ("TrainingArguments",)),
                        ("trl", os.path.join("trainer", "sft_config.py"), ("SFTConfig",)))


@functools.cache
def library_flags() -> dict[str, str]:
    """Every field of TrainingArguments and SFTConfig, by name, with the class it belongs to: read from the
    installed sources without importing them (importing TrainingArguments imports torch, seconds that a refused
    command line need not wait)."""
    flags: dict[str, str] = {}
    for package, path, classes in LIBRARY_FLAG_CLASSES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        with open(os.path.join(spec.submodule_search_locations[0], path)) as file:
            tree = ast.parse(file.read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in classes:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        flags.setdefault(item.target.id, node.name)
    return flags


def not_taken_hint(name: str) -> str | None:
    """The hint for one of TrainingArguments' or SFTConfig's flags that the recipe does not have; None for others."""
    owner, instead = NOT_TAKEN.get(name, (library_flags().get(name), "see --help for the recipe's flags."))
    return f"a {owner} flag shardtune does not take: {instead}" if owner else None


def normalized(flag: str) -> str:
    """'--Learning-Rate' -> 'learning_rate': how the tables are keyed."""
    return flag.lstrip("-").lower().replace("-", "_")


def meaning_table() -> dict[str, str]:
    """Every other trainer's name, normalized, with the hint it gets."""
    table = {name: f"shardtune calls it {flag}." for flag, names in RENAMED.items() for name in names}
    table.update({name: hint for names, hint in GUIDANCE.items() for name in names})
    return table


MEANINGS = meaning_table()


def flag_hint(flag: str, known: Iterable[str], value: str | None = None) -> str:
    """The hint for an unknown flag given `value`: its meaning if another trainer uses the name; a flag of
    TrainingArguments or SFTConfig the recipe does not take, as such (a flag of `accelerate launch` before them, as the
    launcher's); else the nearest spelling of a known flag,
    else --help. A name of an accelerate config file, or one nearest to --config_file, is pointed at the launcher:
    the recipe's --config_file trains nothing."""
    name = normalized(flag)
    if name in CONFIG_FILE_NAMES:
        return config_file_hint(value)
    meaning = MEANINGS.get(name) or MEANINGS.get(name.rsplit(".", 1)[-1])
    if meaning:
        return meaning
    known = list(known)
    if f"--{name}" in launcher_flags() and f"--{name}" not in known:
        return launcher_hint(f"--{name}", value)
    not_taken = not_taken_hint(name) if f"--{name}" not in known else None  # not a recipe flag's other spelling
    if not_taken:
        return not_taken
    nearest = difflib.get_close_matches(f"--{name}", known, n=1) or difflib.get_close_matches(flag, known, n=1)
    if nearest == ["--config_file"]:
        return config_file_hint(value)
    return f"did you mean {nearest[0]}?" if nearest else "see --help for the recipe's flags."

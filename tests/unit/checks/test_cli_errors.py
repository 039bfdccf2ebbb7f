"""The flags users bring from transformers' TrainingArguments, and the recipe values they become."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from transformers import get_scheduler

from shardtune.checks.flag_hints import CONFIG_FILE_NAMES, MEANINGS, RENAMED
from shardtune.config import Recipe
from shardtune.flags import ALIASES, parse_flags, parse_recipe
from tests.conftest import REPO

SPELLINGS = [
    # (the recipe's own values, the command line, the values it must end with)
    ({"mixed_precision": "no"}, ["--bf16", "true"], {"mixed_precision": "bf16"}),
    ({"mixed_precision": "no"}, ["--bf16"], {"mixed_precision": "bf16"}),  # a bool flag alone means true
    ({"mixed_precision": "bf16"}, ["--fp16", "true"], {"mixed_precision": "fp16"}),
    ({"mixed_precision": "bf16"}, ["--bf16", "false"], {"mixed_precision": "no"}),  # TrainingArguments' fp32
    ({"mixed_precision": "bf16"}, ["--fp16", "false"], {"mixed_precision": "bf16"}),  # switches off fp16 only
    ({"mixed_precision": "fp16"}, ["--bf16", "false", "--fp16", "false"], {"mixed_precision": "no"}),
    ({"mixed_precision": "no"}, ["--mixed_precision", "bf16", "--bf16", "true"], {"mixed_precision": "bf16"}),
    ({"warmup_ratio": 0.05}, ["--warmup_steps", "7"], {"warmup_steps": 7, "warmup_ratio": 0.0}),
    ({"warmup_ratio": 0.05}, ["--warmup_steps=7"], {"warmup_steps": 7, "warmup_ratio": 0.0}),
    ({"warmup_ratio": 0.05}, ["--warmup_steps", "7", "--warmup_ratio", "0"], {"warmup_steps": 7, "warmup_ratio": 0.0}),
    ({"warmup_ratio": 0.05}, ["--warmup_steps", "0"], {}),  # 0: the ratio stays in charge
    ({"gradient_checkpointing": True}, ["--gradient_checkpointing_kwargs", '{"use_reentrant": false}'], {}),
]


@pytest.mark.parametrize(("values", "argv", "expected"), SPELLINGS, ids=[" ".join(case[1]) for case in SPELLINGS])
def test_training_arguments_spellings(values, argv, expected):
    recipe = Recipe(name="x", **values)
    assert parse_recipe(recipe, argv) == dataclasses.replace(recipe, **expected)


def test_warmup_steps_set_the_schedule():
    """The trainer's scheduler warms up over --warmup_steps optimizer steps (Recipe.warmup_steps_for), and over
    --warmup_ratio of them without it."""
    assert Recipe(warmup_ratio=0.05).warmup_steps_for(100) == 5
    recipe = parse_recipe(Recipe(warmup_ratio=0.05), ["--warmup_steps", "4"])
    assert recipe.warmup_steps_for(100) == 4
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=recipe.warmup_steps_for(10), num_training_steps=10)
    rates = []
    for _ in range(6):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[:5] == [0.0, 0.25, 0.5, 0.75, 1.0] and rates[5] < 1.0  # the peak at step 4, then the decay


def test_help_documents_the_spellings(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(Recipe(), ["--help"])
    assert exit_info.value.code == 0
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps lines wherever it likes
    for flag, text in {**ALIASES, "--warmup_steps": "Warm-up optimizer steps, instead of --warmup_ratio"}.items():
        assert flag in help_text and "".join(text.split()) in help_text, flag


# Names other trainers (TRL, axolotl, torchtune, transformers) give the recipe's settings: refused, with the
# recipe's flag for what they mean rather than the nearest spelling (which named --lora_r for --lr).
MEANT = {
    "--lr": "shardtune calls it --learning_rate.",
    "--LR": "shardtune calls it --learning_rate.",
    "--optimizer.lr": "shardtune calls it --learning_rate.",  # torchtune's dotted key
    "--model": "shardtune calls it --model_name_or_path.",  # not --save_model
    "--model_name": "shardtune calls it --model_name_or_path.",
    "--base_model": "shardtune calls it --model_name_or_path.",
    "--micro_batch_size": "shardtune calls it --per_device_train_batch_size.",  # not --global_batch_size
    "--per_device_batch_size": "shardtune calls it --per_device_train_batch_size.",  # not the eval batch
    "--batch_size": "--per_device_train_batch_size is the micro-batch per GPU; --global_batch_size",
    "--train_batch_size": "--per_device_train_batch_size is the micro-batch per GPU; --global_batch_size",
    "--gradient_accumulation": "shardtune calls it --gradient_accumulation_steps.",
    "--max_length": "shardtune calls it --max_seq_length.",
    "--sequence_len": "shardtune calls it --max_seq_length.",
    "--max_seq_len": "shardtune calls it --max_seq_length.",
    "--tokenizer.max_seq_len": "shardtune calls it --max_seq_length.",
    "--num_epochs": "shardtune calls it --num_train_epochs.",
    "--deepspeed": "DeepSpeed is chosen by the accelerate config, not a recipe flag: accelerate launch --config_file "
                   "accelerate_configs/ds_zero3.yaml",  # not --seed
    "--fsdp": "FSDP is chosen by the accelerate config, not a recipe flag: accelerate launch --config_file "
              "accelerate_configs/fsdp_full_shard.yaml",
    "--compile": "shardtune calls it --torch_compile.",
    "--torch_dtype": "the training precision is --mixed_precision (bf16, fp16 or no",  # not only --save_dtype
    "--output": "shardtune calls it --output_dir.",
    "--lora_rank": "shardtune calls it --lora_r.",
    "--lora_target": "shardtune calls it --lora_target_modules.",
    "--sample_packing": "shardtune calls it --packing.",
    "--padding_free": "shardtune calls it --packing.",
    "--packed": "shardtune calls it --packing.",
    "--wandb_entity": "WANDB_ENTITY=<entity>; the project is --wandb_project.",
    "--wandb_name": "shardtune calls it --run_name.",
    "--train_on_inputs": "--completion_only_loss false trains on prompt tokens too",
}


@pytest.mark.parametrize("flag", MEANT)
def test_other_trainers_names_refused_with_the_recipe_flag(flag):
    _, problems = parse_flags(Recipe(), [flag, "1"])
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith(f"Unknown argument {flag}: ") and MEANT[flag] in problems[0], problems[0]


@pytest.mark.parametrize("flag,nearest", [("--learning_rat", "--learning_rate"), ("--Learning_Rate", "--learning_rate"),
                                          ("--lora_alpah", "--lora_alpha")])
def test_typos_still_get_the_nearest_spelling(flag, nearest):
    _, problems = parse_flags(Recipe(), [flag, "1"])
    assert problems == [f"Unknown argument {flag}: did you mean {nearest}?"]


def test_hint_tables_name_real_flags_and_files():
    known = {f"--{item.name}" for item in dataclasses.fields(Recipe)} | set(ALIASES)
    assert set(RENAMED) <= known
    assert not [name for name in MEANINGS if f"--{name}" in known], "a recipe flag must not be hinted away"
    named = {word for hint in MEANINGS.values() for word in re.findall(r"--\w+", hint)}
    assert named <= known | {"--config_file"}, named - known
    configs = {path for hint in MEANINGS.values() for path in re.findall(r"accelerate_configs/[\w.]+\.yaml", hint)}
    assert configs and all((REPO / path).is_file() for path in configs)
    assert parse_recipe(Recipe(), ["--learning-rate", "2e-5"]).learning_rate == 2e-5  # hyphens are the flag's own


@pytest.mark.parametrize("argv", [["--config", "x.yaml"], ["--config=x.yaml"], ["--accelerate_config", "x.yaml"],
                                  ["--confg_file", "x.yaml"], ["--cfg", "x.yaml"]])
def test_a_config_flag_is_pointed_at_the_launcher_not_the_recipe_s_config_file(argv):
    """The recipe's --config_file only plans a config (with --dry_run): a name for an accelerate config, or a
    misspelling nearest to --config_file, gets the launch line that trains under it."""
    known = {f"--{item.name}" for item in dataclasses.fields(Recipe)} | set(ALIASES)
    assert not known & {f"--{name}" for name in CONFIG_FILE_NAMES}
    _, problems = parse_flags(Recipe(), argv)
    assert len(problems) == 1 and "did you mean" not in problems[0], problems
    assert "is read by the launcher: accelerate launch --config_file x.yaml " in problems[0], problems[0]
    assert problems[0].endswith("(a recipe's own --config_file only plans it, with --dry_run).")


# TrainingArguments' and SFTConfig's flags shardtune does not take: refused as theirs, not as the recipe flag
# nearest in spelling (each of these named one that means something else).
NOT_TAKEN = {
    "--logging_dir": ("a TrainingArguments flag shardtune does not take: metrics go to output_dir/metrics.jsonl",
                      "--logging_steps sets how often"),
    "--dataloader_num_workers": ("a TrainingArguments flag shardtune does not take: the data is tokenized before "
                                 "training (--dataset_num_proc processes", "no loader workers"),
    "--dataset_text_field": ("a SFTConfig flag shardtune does not take: each --dataset source's format is read from "
                             "its columns", "--dataset_format text"),
    "--tf32": ("a TrainingArguments flag shardtune does not take: see --help for the recipe's flags.", ""),
}


@pytest.mark.parametrize("flag", NOT_TAKEN)
def test_library_flags_it_does_not_take_are_refused_as_theirs(flag):
    _, problems = parse_flags(Recipe(), [flag, "1"])
    start, end = NOT_TAKEN[flag]
    assert len(problems) == 1 and problems[0].startswith(f"Unknown argument {flag}: {start}"), problems
    assert end in problems[0] and "did you mean" not in problems[0], problems



# A setting given twice is compared by the value its flag's action parses, not by its text.
SAME_VALUE_TWICE = [  # (the first occurrence, the second)
    (["--gradient_checkpointing"], ["--gradient_checkpointing", "true"]),
    (["--gradient_checkpointing", "false"], ["--no_gradient_checkpointing"]),
    (["--learning_rate", "1e-5"], ["--learning_rate", "1e-05"]),
    (["--learning_rate=1e-5"], ["--learning_rate", "0.00001"]),
    (["--loss_type", "sigmoid", "hinge"], ["--loss_type", "sigmoid", "hinge"]),
]
OTHER_VALUE_TWICE = {
    "a list flag's later items": (["--loss_type", "sigmoid", "sft", "--loss_type", "sigmoid", "hinge"],
                                  "--loss_type sigmoid sft, --loss_type sigmoid hinge"),
    "a bare switch and its negation": (["--gradient_checkpointing", "--no_gradient_checkpointing"],
                                       "--gradient_checkpointing, --no_gradient_checkpointing"),
    "a switch alone and false": (["--gradient_checkpointing", "--learning_rate", "1e-5", "--gradient_checkpointing",
                                  "false"], "--gradient_checkpointing, --gradient_checkpointing false"),
    "a number and another": (["--learning_rate", "1e-5", "--learning_rate=2e-05"],
                             "--learning_rate 1e-5, --learning_rate 2e-05"),
}


@pytest.mark.parametrize(("first", "second"), SAME_VALUE_TWICE,
                         ids=[" ".join(first + second) for first, second in SAME_VALUE_TWICE])
def test_a_setting_given_twice_at_one_value_is_taken(first, second):
    recipe, problems = parse_flags(Recipe(gradient_checkpointing=False), first + second)
    assert problems == []
    assert recipe == parse_recipe(Recipe(gradient_checkpointing=False), first) == parse_recipe(
        Recipe(gradient_checkpointing=False), second)


@pytest.mark.parametrize("case", OTHER_VALUE_TWICE)
def test_a_setting_given_twice_at_two_values_is_refused(case):
    argv, spelled = OTHER_VALUE_TWICE[case]
    _, problems = parse_flags(Recipe(), argv)
    assert problems == [f"{spelled}: the same setting given 2 times, and only the last would apply: give it once."]


def test_a_value_the_flag_does_not_take_is_not_part_of_its_setting():
    """`--max_steps 5 6`: 6 is refused as a stray value, and is no part of --max_steps' two occurrences."""
    _, problems = parse_flags(Recipe(), ["--max_steps", "5", "6", "--max_steps=5"])
    assert problems == ["Unexpected value '6' on the command line: every value follows its flag (--name value); "
                        "see --help."]

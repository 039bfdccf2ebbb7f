"""The command line of a recipe: every Recipe field as a flag, transformers' TrainingArguments spellings mapped onto
them, and one message per flag problem."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

# hf_argparser alone: the transformers package without its models, so that a bad flag is refused at once.
from transformers.hf_argparser import HfArgumentParser, string_to_bool

from shardtune.checks.flag_hints import flag_hint
from shardtune.config import ConfigError, Recipe


class RecipeHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each flag the value it takes when not given (an empty string shown as ''), and a --no_<flag>
    complement of a boolean one line of its own instead of a copy of its flag's help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        switched_off = [option for option in action.option_strings if option.startswith("--no_")]
        if switched_off and action.dest == switched_off[0][len("--no_"):]:
            return f"Same as --{action.dest} false."
        help_text = super()._get_help_string(action)
        return help_text.replace("%(default)s", "''") if action.default == "" and help_text else help_text


class RecipeParser(HfArgumentParser):
    """argparse's own errors (a bad value such as `--packing maybe`) as ConfigError: one line, exit code 2."""

    def __init__(self, dataclass_types: type, **kwargs) -> None:
        kwargs.setdefault("formatter_class", RecipeHelpFormatter)
        super().__init__(dataclass_types, **kwargs)

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


def recipe_parser(recipe: Recipe) -> RecipeParser:
    """Every Recipe field as a flag with the recipe's value as its default, and TrainingArguments' spellings."""
    parser = RecipeParser(Recipe)
    parser.allow_abbrev = False  # a typo such as --learning_rat must not pass as --learning_rate
    group = parser.add_argument_group("TrainingArguments spellings")
    for flag in ("--bf16", "--fp16"):  # as HfArgumentParser reads a bool field: `--bf16` alone means true
        group.add_argument(flag, type=string_to_bool, nargs="?", const=True, default=None, metavar="true|false",
                           help=ALIASES[flag])
    group.add_argument("--gradient_checkpointing_kwargs", default=None, metavar="JSON",
                       help=ALIASES["--gradient_checkpointing_kwargs"])
    parser.set_defaults(**dataclasses.asdict(recipe))
    return parser


def parse_flags(recipe: Recipe, argv: list[str] | None = None) -> tuple[Recipe, list[str]]:
    """The recipe with the command line applied, and the flags' problems (unknown or conflicting flags), one
    message each, so that the recipe's other checks still run. A value argparse cannot read raises at once."""
    parser = recipe_parser(recipe)
    args = sys.argv[1:] if argv is None else argv
    overridden, aliases, unknown = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
    problems = unknown_argument_problems(unknown, recipe_flag_hint) + repeated_flag_problems(parser, args)
    for apply in (expand_home, apply_precision_alias, apply_warmup_steps, apply_constant_schedule,
                  apply_accumulation_steps, check_checkpointing_kwargs, check_given_flags_act):
        try:
            overridden = apply(overridden, aliases, args) or overridden
        except ConfigError as error:
            problems.extend(error.messages)
    return overridden, problems


def given_fields(recipe: Recipe, argv: list[str] | None = None) -> frozenset[str]:
    """The Recipe fields the command line gives, at whatever value: a flag given at its default (--lora_alpha 32)
    is given all the same, which no comparison with the defaults can tell. --no_<flag> gives <flag>, and
    TrainingArguments' --bf16 and --fp16 give --mixed_precision."""
    args = sys.argv[1:] if argv is None else argv
    actions = recipe_parser(recipe)._option_string_actions  # argparse's own map of each spelling to its action
    dests = {actions[token.partition("=")[0]].dest for token in args if token.partition("=")[0] in actions}
    fields = {item.name for item in dataclasses.fields(Recipe)}
    return frozenset({"mixed_precision" if dest in ("bf16", "fp16") else dest for dest in dests} & fields)


RECIPE_DEFAULTS = dataclasses.asdict(Recipe())


def set_fields(recipe: Recipe, names: Sequence[str], given: frozenset[str]) -> list[str]:
    """Those of `names` the run sets: given on the command line (at any value, its default included), or set by
    the recipe to other than Recipe's default."""
    return [name for name in names if name in given or getattr(recipe, name) != RECIPE_DEFAULTS[name]]


def given(args: Sequence[str], flag: str) -> bool:
    """Whether `flag` is on the command line (abbreviations are off, so only its exact spelling counts)."""
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in args)


def is_flag(token: str) -> bool:
    """A command-line token that names a flag, not a (negative) value."""
    return token.startswith("--") or (token.startswith("-") and not token[1:2].isdigit())


def unknown_argument_problems(unknown: Sequence[str], hint: Callable[[str, str | None], str]) -> list[str]:
    """One message per flag a parser does not know, `hint(flag, its value or None)` naming the flag it most likely
    meant; a value that follows an unknown flag is its value, not a problem of its own. The recipe's parser and the
    planner's share it, each with its own hint."""
    problems, after_flag = [], False
    for index, token in enumerate(unknown):
        if is_flag(token):
            flag, _, value = token.partition("=")
            following = unknown[index + 1] if index + 1 < len(unknown) else ""
            value = value or (following if following and not is_flag(following) else "")
            problems.append(f"Unknown argument {flag}: {hint(flag, value or None)}")
            after_flag = "=" not in token
        elif after_flag:
            after_flag = False
        else:
            problems.append(f"Unexpected value {token!r} on the command line: every value follows its flag "
                            "(--name value); see --help.")
    return problems


def recipe_flag_hint(flag: str, value: str | None) -> str:
    """The hint for a flag the recipe does not know (shardtune.checks.flag_hints)."""
    known = [f"--{item.name}" for item in dataclasses.fields(Recipe)] + list(ALIASES)
    return flag_hint(flag, known, value)


def repeated_flag_problems(parser: argparse.ArgumentParser, args: Sequence[str]) -> list[str]:
    """One message per setting the command line gives more than once with different values (argparse keeps the
    last and drops the others without a word: `--dataset a.jsonl --dataset b.jsonl` would train on b alone),
    whichever of its spellings each time (--gradient_checkpointing and --no_gradient_checkpointing set one
    field). Each occurrence (its flag and every token after it up to the next flag, or its `=value`) is parsed by
    that flag's own action in `parser`, and the parsed values are compared, not the text: `--gradient_checkpointing`
    and `--gradient_checkpointing true`, `--learning_rate 1e-5` and `--learning_rate 1e-05` give one value, and a
    list flag's every item counts. The same value given twice acts as given."""
    actions = parser._option_string_actions  # argparse's own map of each spelling to its action
    given: dict[str, list[tuple[str, object]]] = {}
    for index, token in enumerate(args):
        name = token.partition("=")[0]
        if not is_flag(token) or name not in actions:
            continue
        following = list(itertools.takewhile(lambda later: not is_flag(later), args[index + 1:]))
        try:  # a fresh namespace: the value this occurrence alone sets
            parsed, rest = parser.parse_known_args([token, *following], argparse.Namespace())
        except ConfigError:  # a value argparse cannot read: the command line's own parse refuses it
            continue
        taken = following[:len(following) - len(rest)]  # the tokens its action took; the rest are not its values
        spelling = " ".join([name, *([token.partition("=")[2]] if "=" in token else taken)])
        given.setdefault(actions[name].dest, []).append((spelling, getattr(parsed, actions[name].dest)))
    problems = []
    for dest, occurrences in given.items():
        if any(value != occurrences[0][1] for _, value in occurrences):
            several = " (several sources go in one: --dataset A,B)" if dest == "dataset" else ""
            problems.append(f"{', '.join(spelling for spelling, _ in occurrences)}: the same setting given "
                            f"{len(occurrences)} times, and only the last would apply: give it once{several}.")
    return problems


# The flags that name local paths, each comma-separated part of them one path.
PATH_FLAGS = ("model_name_or_path", "dataset", "eval_split", "chat_template", "output_dir", "resume_from_checkpoint",
              "offload_nvme_path", "config_file")


def expand_home(recipe: Recipe, aliases: argparse.Namespace, args: Sequence[str]) -> Recipe | None:
    """`~/runs/x` as the home directory's, as TrainingArguments expands --output_dir: the shell leaves a `~` after
    `=` (--output_dir=~/runs/x) as it is, and the run would make a directory named `~` in the working directory."""
    expanded = {name: ",".join(os.path.expanduser(part.strip()) if part.strip().startswith("~") else part
                               for part in getattr(recipe, name).split(","))
                for name in PATH_FLAGS if "~" in getattr(recipe, name)}
    return dataclasses.replace(recipe, **expanded) if expanded else None


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
    (schedule.check_schedule), as it would be ambiguous which one the scheduler follows."""
    if recipe.warmup_steps > 0 and given(args, "--warmup_steps") and not given(args, "--warmup_ratio"):
        return dataclasses.replace(recipe, warmup_ratio=0.0)
    return None


def apply_constant_schedule(recipe: Recipe, aliases: argparse.Namespace, args: Sequence[str]) -> Recipe | None:
    """`--lr_scheduler_type constant` on the command line drops the recipe's warm-up, which that schedule has
    none of; a warm-up given beside it stays, and is refused if it is one (schedule.check_schedule)."""
    if recipe.lr_scheduler_type != "constant" or not given(args, "--lr_scheduler_type"):
        return None
    return dataclasses.replace(recipe, **{name: none for name, none in (("warmup_ratio", 0.0), ("warmup_steps", 0))
                                          if not given(args, f"--{name}")})


def apply_accumulation_steps(recipe: Recipe, aliases: argparse.Namespace, args: Sequence[str]) -> Recipe | None:
    """`--gradient_accumulation_steps N` alone on the command line sets the global batch (micro-batch x N x
    ranks) in place of the recipe's --global_batch_size; both given must agree (checks.batch_sizes)."""
    if given(args, "--gradient_accumulation_steps") and not given(args, "--global_batch_size") \
            and recipe.global_batch_size is not None:
        return dataclasses.replace(recipe, global_batch_size=None)
    return None


def check_given_flags_act(recipe: Recipe, aliases: argparse.Namespace, args: Sequence[str]) -> None:
    """Flags given on the command line that this run would ignore (a recipe's own values may sit unused)."""
    ignored = [(flag, why) for flag, why, unused in (
        ("--eval_fraction", "--eval_split holds out a split of its own", bool(recipe.eval_split)),
        ("--wandb_project", "--report_to none logs to no tracker", recipe.report_to == "none"),
        ("--run_name", "--report_to none logs to no tracker", recipe.report_to == "none"),
        ("--num_train_epochs", f"--max_steps {recipe.max_steps} sets the run's length", recipe.max_steps > 0),
    ) if unused and given(args, flag)]
    if ignored:
        raise ConfigError([f"{flag} would be ignored: {why}. Drop it." for flag, why in ignored])


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

"""Memory plan per GPU, before a single weight is loaded: model states, activations and buffers for any model x
hardware x accelerate config, and the fastest config, checkpointing and micro-batch that fit.

    python -m shardtune.plan --model llama-3.1-70b --hardware 8xh100-80gb                  # recommendation
    python -m shardtune.plan --model recipes/llama8b.py --config_file accelerate_configs/fsdp_full_shard.yaml
    python -m shardtune.plan --model llama-3.1-8b --compare --chart plan.png

All sizes are bytes. GB in output is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import sys
import typing
from collections.abc import Callable

from shardtune.checks.command_line import OneLineParser
from shardtune.checks.flag_hints import RENAMED
from shardtune.checks.model import expert_refusals
from shardtune.checks.startup import batch_sizes
from shardtune.config import FIELD_CHOICES, ConfigError, Recipe, below_lowest
from shardtune.flags import unknown_argument_problems
from shardtune.hub import is_hub_id, probe_hub
from shardtune.models.flops import (
    BUILTIN_MODELS,
    ModelError,
    ModelShape,
    builtin_name,
    recipe_fields,
    resolve_config,
    shape_from_config,
)
from shardtune.plan.hardware import HardwareError, parse_hardware
from shardtune.plan.planned_run import (
    MODEL_DEFAULTS,
    check_planned,
    is_recipe,
    plan_recipe,
    planned_recipe,
    recipe_peft,
    recipe_reference,
    recipe_reference_shape,
    recipe_search,
)
from shardtune.plan.report import format_compare, format_plan, write_chart
from shardtune.plan.search import config_paths, launch_command, recommend
from shardtune.plan.strategy import PlanError, read_accelerate_config
from shardtune.plan.tensor import tensor_parallel_problems

# The flags that set a field of the planned run: the recipe's own, with its help and choices; each overrides the
# recipe's value.
RUN_FLAGS = ("per_device_train_batch_size", "global_batch_size", "gradient_accumulation_steps", "max_seq_length",
             "pad_to_multiple_of",
             "gradient_checkpointing", "gradient_checkpointing_interval", "gradient_checkpointing_mode",
             "activation_offloading", "mixed_precision",
             "attn_implementation", "packing", "chunked_cross_entropy", "torch_compile", "use_liger_kernel", "optim",
             "bf16_stochastic_round", "use_peft", "lora_r", "lora_target_modules", "load_in_4bit",
             "per_device_eval_batch_size", "async_save", "save_only_model", "method", "precompute_ref_log_probs",
             "ref_model_name_or_path")
# The flags the recommendation searches over when they are not given (a recipe gives them all), and their words.
SEARCHED_FLAGS = {"per_device_train_batch_size": "micro-batch", "gradient_checkpointing": "checkpointing",
                  "gradient_checkpointing_mode": "checkpointing mode", "optim": "optimizer",
                  "bf16_stochastic_round": "optimizer"}
# What a run flag's plan adds to the recipe's help; and where a bare model's default is not a value of its own.
PLAN_NOTES = {
    "global_batch_size": "the recommendation keeps it, deriving accumulation; a plan of --config_file or --compare "
                         "does not depend on it",
    "attn_implementation": "planned as sdpa and eager holding a dense mask, the flash kernels and flex_attention none",
    "torch_compile": "planned as eager: compilation keeps at most eager's activations",
    "use_liger_kernel": "with it a recommendation searches full checkpointing only",
    "per_device_eval_batch_size": "eval's activations are planned as a phase",
    "pad_to_multiple_of": "planned at --max_seq_length rounded up to it",
    "method": "dpo plans each pair as two sequences and the reference model as it is held (docs/dpo.md)",
    "ref_model_name_or_path": "any value makes a LoRA run's reference live; planned in its own shape, from its "
                              "config.json or a built-in name",
}
MODEL_DEFAULT_WORDS = {"mixed_precision": "the accelerate config's; a recommendation's: bf16, which it never trades "
                                          "for fp8"}


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m shardtune.plan", description=" ".join(__doc__.split("\n\n")[0].split()),
                           allow_abbrev=False,  # a typo such as --micro_batch must not pass as another flag
                           see="--help for the planner's flags")
    parser.add_argument("--model", required=True,
                        help="Built-in name, any Hugging Face model id (only its config.json is fetched), a local "
                             "model directory or config.json, or a recipe file")
    parser.add_argument("--hardware", default="8xh100-80gb",
                        help="e.g. 8xh100-80gb, 2x8xh100-80gb, 4x40gb (default: %(default)s)")
    parser.add_argument("--num_machines", type=int,
                        help="Nodes of --hardware, as accelerate launch counts them: --hardware 8xh100-80gb "
                             "--num_machines 2 plans 2x8xh100-80gb (default: the nodes --hardware names, else 1)")
    parser.add_argument("--config_file", help="accelerate config YAML; without it, recommend one")
    parser.add_argument("--host_ram_gb", type=float,
                        help="Host RAM per node in GB (default: 250 GB per GPU, as DGX nodes carry)")
    parser.add_argument("--compare", action="store_true",
                        help="All accelerate_configs/*.yaml side by side (the multi-node layouts, fsdp_hybrid_shard "
                             "and ds_zero3_hpz, on 2 or more nodes)")
    parser.add_argument("--chart", help="Write --compare's per-GPU peaks as a stacked-bar PNG here (implies "
                                        "--compare)")
    parser.add_argument("--json", action="store_true", help="Print the plan as one JSON object instead of a table")
    add_run_flags(parser)
    try:
        args, unknown = parser.parse_known_args(argv)
        problems = unknown_argument_problems(unknown, planner_hint(parser)) + check_args(args)
        if not problems:
            return _run(args)
    except (PlanError, HardwareError) as error:
        problems = [str(error)]
    except ModelError as error:  # its words are the recipe's, whose flag for the model the planner calls --model
        problems = [str(error).replace("--model_name_or_path", "--model")]
    except SyntaxError as error:  # --model names a Python file that is no recipe (read without running it)
        problems = [f"--model {args.model!r} does not parse as Python ({error.msg}, line {error.lineno}): give a "
                    "recipe file, e.g. recipes/llama8b.py."]
    except ConfigError as error:
        problems = error.messages
    for problem in problems:
        print(f"shardtune.plan: error: {problem}", file=sys.stderr)
    return 2


def planner_hint(parser: argparse.ArgumentParser) -> Callable[[str, str | None], str]:
    """The hint for a flag the planner does not take, naming the planner's flag it most likely meant: by the names
    other trainers give it (shardtune.checks.flag_hints.RENAMED), else by spelling."""
    known = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]

    def hint(flag: str, value: str | None) -> str:
        name = flag.lstrip("-").lower().replace("-", "_")
        renamed = [target for target, names in RENAMED.items() if name in names and target in known]
        nearest = renamed or difflib.get_close_matches(flag, known, n=1)
        return f"did you mean {nearest[0]}?" if nearest else "see --help for the planner's flags."
    return hint


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Each RUN_FLAGS field as the recipe's flag, with its help, type and choices. A recipe's plan takes the
    recipe's value (Recipe's default where the recipe leaves it out), a bare model's MODEL_DEFAULTS or Recipe's."""
    group = parser.add_argument_group("the planned run", "A recipe's flags: each overrides the recipe's value.")
    fields, types = {item.name: item for item in dataclasses.fields(Recipe)}, typing.get_type_hints(Recipe)
    for name in RUN_FLAGS:
        kind = typing.get_args(types[name])[0] if typing.get_args(types[name]) else types[name]  # int | None: int
        default = MODEL_DEFAULTS.get(name, fields[name].default)
        model_default = MODEL_DEFAULT_WORDS.get(name) or (str(default).lower() if isinstance(default, bool)
                                                          else default)
        notes = [f"default: the recipe's; for a model, {model_default}" if model_default not in (None, "")
                 else "default: the recipe's",
                 *(["a recommendation for a model searches it unless given"] if name in SEARCHED_FLAGS else []),
                 *([PLAN_NOTES[name]] if name in PLAN_NOTES else [])]
        group.add_argument(f"--{name}", type=_bool if kind is bool else kind, choices=FIELD_CHOICES.get(name),
                           metavar="true|false" if kind is bool else None,
                           help=f"{fields[name].metadata['help']} ({'; '.join(notes)})")


def check_args(args: argparse.Namespace) -> list[str]:
    """Every impossible value and every flag that would not act, one line each, before anything is planned."""
    problems = model_name_problems(args.model)
    problems += below_lowest((f"--{name}", getattr(args, name)) for name in
                            ("per_device_train_batch_size", "per_device_eval_batch_size", "global_batch_size",
                             "max_seq_length", "pad_to_multiple_of", "lora_r"))
    if args.num_machines is not None and args.num_machines < 1:
        problems.append(f"--num_machines must be >= 1, got {args.num_machines}.")
    if args.host_ram_gb is not None and not args.host_ram_gb > 0:
        problems.append(f"--host_ram_gb is host RAM per node in GB and must be > 0, got {args.host_ram_gb}.")
    peft_flags = [f"--{name}" for name in ("lora_r", "lora_target_modules", "load_in_4bit")
                  if getattr(args, name) is not None]
    if peft_flags and not _uses_peft(args):
        problems.append(f"{', '.join(peft_flags)} shape{'s' if len(peft_flags) == 1 else ''} LoRA adapters: add "
                        "--use_peft true, or drop them.")
    dpo_flags = [f"--{name}" for name in ("precompute_ref_log_probs", "ref_model_name_or_path")
                 if getattr(args, name) is not None]
    if dpo_flags and not _is_dpo(args):
        problems.append(f"{', '.join(dpo_flags)} place{'s' if len(dpo_flags) == 1 else ''} DPO's reference: add "
                        "--method dpo, or drop them.")
    if args.chart and not args.chart.lower().endswith(".png"):
        problems.append(f"--chart writes a PNG: give a path ending in .png, got {args.chart!r}.")
    elif args.chart:
        problems += chart_problems(args.chart)
    if args.config_file and not os.path.isfile(args.config_file):
        problems.append(f"--config_file {args.config_file!r} does not exist: give an accelerate config YAML, e.g. "
                        "accelerate_configs/fsdp_full_shard.yaml.")
    compare = "--chart" if args.chart and not args.compare else "--compare"
    if args.config_file and (args.compare or args.chart):
        problems.append(f"{compare} plans every shipped config and --config_file one: give one of them.")
    if args.global_batch_size is not None and (args.config_file or args.compare or args.chart):
        problems.append(f"--global_batch_size sets the recommendation's accumulation; the plan of "
                        f"{'--config_file' if args.config_file else compare} does not depend on it: drop it, or "
                        "drop that flag for a recommendation.")
    if args.gradient_accumulation_steps is not None and not (args.config_file or args.compare or args.chart) \
            and args.per_device_train_batch_size is None and not is_recipe(args.model):
        problems.append("--gradient_accumulation_steps: a model's recommendation searches the micro-batch and derives "
                        "accumulation from the global batch: give --per_device_train_batch_size with it, or "
                        "--global_batch_size alone.")
    return problems


def chart_problems(chart: str) -> list[str]:
    """--chart's folder exists and takes a new file, checked before anything is planned (PIL's own error comes
    after the plans, as a traceback)."""
    folder = os.path.dirname(chart) or "."
    if os.path.isdir(chart):
        return [f"--chart {chart!r} is a directory: give the PNG's file name, e.g. {os.path.join(chart, 'plan.png')}."]
    if not os.path.isdir(folder):
        return [f"--chart {chart!r}: the folder {folder!r} does not exist: create it (mkdir -p {folder}) or give a "
                "path in an existing folder."]
    if not os.access(folder, os.W_OK | os.X_OK):
        return [f"--chart {chart!r}: the folder {folder!r} is not writable: give a path in a folder you can write."]
    return []


def model_name_problems(model: str) -> list[str]:
    """--model that is no recipe, file or directory here, no built-in shape and no Hub id (owner/name): refused at
    once with the nearest built-in name, instead of asking the Hub for it."""
    if os.path.exists(model) or builtin_name(model) or is_hub_id(model):
        return []
    if model.endswith((".py", ".json")) or os.sep in model.strip(os.sep):
        return [f"--model {model!r} does not exist: give a recipe file, a model directory or its config.json, a "
                f"built-in name ({', '.join(BUILTIN_MODELS)}) or a Hub model id (owner/name)."]
    nearest = difflib.get_close_matches(model.lower(), BUILTIN_MODELS, n=1, cutoff=0.5)
    hint = f"did you mean {nearest[0]}? " if nearest else ""
    return [f"--model {model!r} is no built-in name, local directory or Hub model id (owner/name): {hint}The "
            f"built-in shapes: {', '.join(BUILTIN_MODELS)}."]


def _uses_peft(args: argparse.Namespace) -> bool:
    """--use_peft as given, else the recipe's."""
    if args.use_peft is not None:
        return args.use_peft
    return is_recipe(args.model) and os.path.isfile(args.model) and bool(recipe_fields(args.model).get("use_peft"))


def _is_dpo(args: argparse.Namespace) -> bool:
    """--method as given, else the recipe's, is dpo."""
    if args.method is not None:
        return args.method == "dpo"
    return is_recipe(args.model) and os.path.isfile(args.model) and recipe_fields(args.model).get("method") == "dpo"


def planned_hardware(args: argparse.Namespace):
    """--hardware, on --num_machines of its nodes where given; a node count in both must agree."""
    hardware = parse_hardware(args.hardware, args.host_ram_gb)
    if args.num_machines is None or args.num_machines == hardware.nodes:
        return hardware
    if re.match(r"^\d+x\d+x", hardware.name):
        raise PlanError(f"--hardware {args.hardware} names {hardware.nodes} nodes and --num_machines "
                        f"{args.num_machines} differs: give the node count in one of them.")
    return hardware.with_nodes(args.num_machines)


def _run(args: argparse.Namespace) -> int:
    hardware = planned_hardware(args)
    if is_hub_id(args.model) and not builtin_name(args.model) and not os.path.exists(args.model):
        probe_hub()  # out of reach: the lookup below fails at once instead of after huggingface_hub's retries
    name, model_config = resolve_config(args.model)
    shape = shape_from_config(model_config, name)
    recipe = planned_recipe(args.model, {flag: getattr(args, flag) for flag in RUN_FLAGS})
    check_planned(recipe, model_config)
    check_reference_shape(recipe, shape)
    if args.gradient_accumulation_steps is not None:  # it must agree with the global batch on this hardware
        batch_sizes(recipe, hardware.world_size)
    peft = recipe_peft(recipe)
    if peft:  # unknown target names: one line now
        peft.trainable_params(shape)
    # A recipe runs in its own precision; a bare model in the accelerate config's (the recommendation: bf16).
    precision = args.mixed_precision or (recipe.mixed_precision if is_recipe(args.model) else None)
    if args.compare or args.chart:
        strategies = [read_accelerate_config(path, precision) for path in config_paths()]
        # The multi-node layouts on one node are fsdp_full_shard, and ds_zero3 with a second copy of the weights.
        planned = [strategy for strategy in strategies if hardware.nodes > 1 or not strategy.multi_node_layout]
        # Tensor parallelism where it runs on this hardware (fsdp_tp: a dp_shard axis of 2 or more): said below.
        refusals = {strategy.name: tensor_parallel_problems(strategy, shape, hardware.world_size, peft,
                                                            recipe_reference(recipe), recipe.use_liger_kernel)
                    for strategy in planned}
        split = [strategy for strategy in planned if refusals[strategy.name]]
        planned = [strategy for strategy in planned if strategy not in split]
        # fp8 trains under FSDP2 without offload and DDP only (levers.float8): the others are left out, and said.
        untaken = [strategy for strategy in planned if strategy.float8 and not strategy.takes_float8]
        plans = [plan_recipe(shape, hardware, strategy, recipe) for strategy in planned if strategy not in untaken]
        if args.chart:
            try:
                write_chart(plans, args.chart)
            except OSError as error:  # what chart_problems cannot foresee (a full disk, a read-only mount)
                raise PlanError(f"--chart {args.chart!r} cannot be written: {error.strerror or error}.") from None
        print(json.dumps([p.to_json() for p in plans]) if args.json else format_compare(plans))
        if untaken and not args.json:
            names = ", ".join(strategy.name for strategy in untaken)
            print(f"Not planned: {names} (--mixed_precision fp8 trains under FSDP2 without offload or context "
                  "parallelism, or DDP).")
        if split and not args.json:
            print(f"Not planned: {', '.join(strategy.name for strategy in split)} (tensor parallelism does not run "
                  f"here: {refusals[split[0].name][0]})")
        return 0
    if args.config_file:
        strategy = read_accelerate_config(args.config_file, precision)
        refused = expert_refusals(recipe, model_config, strategy.sequence_split, strategy.context_parallel)
        if refused:  # the axes a mixture of experts refuses at launch (shardtune.models.experts)
            raise ConfigError(refused)
        result = plan_recipe(shape, hardware, strategy, recipe)
        print(json.dumps(result.to_json()) if args.json else format_plan(result))
        return 0 if result.fits else 1
    held = [flag for flag in SEARCHED_FLAGS if is_recipe(args.model) or getattr(args, flag) is not None]
    search = recipe_search(recipe, hardware, precision or "bf16", held)
    found = recommend(shape, hardware, search)
    searched = ["the accelerate config"] + list(dict.fromkeys(
        SEARCHED_FLAGS[flag] for flag in SEARCHED_FLAGS if flag not in held
        and not (flag == "gradient_checkpointing_mode" and search.checkpointing is False)
        and not (SEARCHED_FLAGS[flag] == "optimizer" and {"optim", "bf16_stochastic_round"} & set(held))))
    held_line = held_note(search.fixed(), [f"--{flag}" for flag in SEARCHED_FLAGS if getattr(args, flag) is not None]
                          + ([args.model] if is_recipe(args.model) else []), searched)
    if args.json:
        body = found.plan.to_json() if found.plan else {"params": shape.params, "fits": False}
        print(json.dumps({**body, "recommendation": found.message, "held": held_line, "gpu_only": found.gpu_only,
                          "accumulation": found.accumulation}))
    else:
        print(found.message)
        if found.plan:
            print(f"Launch: {launch_command(found.plan, args.model if is_recipe(args.model) else 'RECIPE')}")
        if held_line:
            print(held_line)
        if found.plan:
            print(format_plan(found.plan))
    return 0 if found.plan else 1


def check_reference_shape(recipe: Recipe, shape: ModelShape) -> None:
    """A reference of its own is read (its config.json; a Hub id's fetched) and scores the policy's token ids, as
    the launch refuses it otherwise (shardtune.methods.checks.check_reference_model)."""
    path = recipe.ref_model_name_or_path
    if path and is_hub_id(path) and not builtin_name(path) and not os.path.exists(path):
        probe_hub()
    reference = recipe_reference_shape(recipe)
    if reference is not None and reference.vocab != shape.vocab:
        raise PlanError(f"--ref_model_name_or_path {path!r} has a vocabulary of {reference.vocab} tokens and the "
                        f"policy {shape.vocab}: the reference scores the policy's token ids, so it must share its "
                        "tokenizer; give a reference of the policy's family and tokenizer.")


def held_note(fixed: str, sources: list[str], searched: list[str]) -> str:
    """The line that says what the recommendation kept as given, from where, and what it searched: '' when it
    kept nothing."""
    return f"Kept as given ({', '.join(sources)}): {fixed}; searched: {' and '.join(searched)}." if fixed else ""


if __name__ == "__main__":
    sys.exit(main())

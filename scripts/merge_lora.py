"""Merge a LoRA adapter (a --use_peft run's output_dir) into its base model and save a plain Hugging Face model.

    python scripts/merge_lora.py outputs/llama8b_lora merged/llama8b [--base meta-llama/Llama-3.1-8B] [--dtype bf16]

The base defaults to the one recorded in adapter_config.json (an absolute path, or a Hub id). An adapter that
records a relative path (written before runs recorded it absolute) is resolved through the run_config.json beside
it, which records the run's model absolute; failing that, the command names --base. --base where the recorded base
is still found must be that base (the same directory, or the Hub id); another model, even of the same shape,
would merge without a word into weights the adapter was not trained on: it is refused unless --other_base says so
(a copy of the base elsewhere). A recorded base that is no longer found (a moved directory) takes --base as given.
Merging is peft's `merge_and_unload`: W + B·A·α/r. The merged model is written under a temporary name, loaded
back (its weights' names and shapes against the model class its config names), then renamed: it appears whole or
not at all, with the file modes any new file gets (0644 under umask 022). A checkpoint-<step> directory is
exported with scripts/export_hf.py instead (merged by default).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from shardtune.checks.command_line import OneLineParser

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# A Hub id: "name" or "owner/name", no path syntax (huggingface_hub's rule, without importing it).
HUB_ID = re.compile(r"[\w][\w.\-]{0,95}(/[\w][\w.\-]{0,95})?")


class Refused(Exception):
    """Bad input: the message names the problem and the fix."""


def base_model(adapter_dir: str, given: str, other_base: bool = False) -> str:
    """The base to merge into: --base, else the adapter's recorded base, resolved (see the module's doc). --base
    must name the recorded base where that is still found, unless `other_base`."""
    if other_base and not given:
        raise Refused("--other_base merges into a base other than the recorded one, which --base names: add --base, "
                      "or drop --other_base.")
    if given:
        if looks_local(given) and not os.path.isdir(given):
            raise Refused(f"--base {given} not found: give the base model's directory or its Hub id.")
        base = os.path.abspath(given) if os.path.isdir(given) else given
        if not other_base:
            check_recorded_base(adapter_dir, given, base)
        return base
    return recorded_base(adapter_dir)


def check_recorded_base(adapter_dir: str, given: str, base: str) -> None:
    """--base against the base adapter_config.json records, where that is still found: the same directory (the
    real paths compared), or the same Hub id. A recorded base not found any more says nothing against --base."""
    try:
        recorded = recorded_base(adapter_dir)
    except Refused:  # not found from here: --base is the fix the refusal names
        return
    if os.path.isdir(recorded) and os.path.isdir(base):
        same = os.path.realpath(recorded) == os.path.realpath(base)
    elif os.path.isdir(base):  # a Hub id's snapshot in the Hugging Face cache is that model
        same = f"models--{recorded.replace('/', '--')}" in Path(os.path.realpath(base)).parts
    else:
        same = recorded == base
    if not same:
        raise Refused(f"--base {given} is not the base {adapter_dir}/adapter_config.json records ({recorded}), "
                      "which the adapter was trained on: drop --base to merge into that one, or pass --base "
                      f"{recorded}; add --other_base to merge into {given} all the same (a copy of that base).")


def recorded_base(adapter_dir: str) -> str:
    """The base adapter_config.json records, resolved: an absolute path that exists, a relative one through the
    run's run_config.json or the working directory, or a Hub id; Refused when it is not found."""
    try:
        with open(os.path.join(adapter_dir, "adapter_config.json")) as file:
            recorded = json.load(file).get("base_model_name_or_path") or ""
    except (ValueError, AttributeError) as error:  # not JSON, or JSON but no object
        raise Refused(f"{adapter_dir}/adapter_config.json is not a JSON object ({first_line(error)}): give the "
                      "output_dir of a --use_peft run, whose adapter_config.json peft wrote.") from None
    if not recorded:
        raise Refused(f"{adapter_dir}/adapter_config.json records no base model: give it with --base.")
    if os.path.isabs(recorded) or recorded.startswith("~"):
        path = os.path.expanduser(recorded)
        if not os.path.isdir(path):
            raise Refused(f"the base model recorded in {adapter_dir}/adapter_config.json, {recorded}, is not found: "
                          "give its directory (or Hub id) with --base.")
        return path
    run_model, tail = run_config_model(adapter_dir), Path(os.path.normpath(recorded)).parts
    if run_model and os.path.isdir(run_model) and Path(run_model).parts[-len(tail):] == tail:
        return run_model  # the path the adapter records, as its run recorded it: absolute
    if os.path.isdir(recorded):
        return os.path.abspath(recorded)
    if looks_local(recorded) or not HUB_ID.fullmatch(recorded):
        raise Refused(f"{adapter_dir}/adapter_config.json records its base as {recorded}, a path relative to the "
                      f"directory its run was started in, not found from {os.getcwd()}: give the base model's "
                      "directory with --base.")
    return recorded  # a Hub id


def looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def run_config_model(adapter_dir: str) -> str:
    """The model the run's run_config.json records (absolute where it was local), or ""."""
    try:
        with open(os.path.join(adapter_dir, "run_config.json")) as file:
            return json.load(file).get("recipe", {}).get("model_name_or_path") or ""
    except (OSError, ValueError):
        return ""


def input_problem(adapter_dir: str, output_dir: str) -> str | None:
    config_file = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isdir(adapter_dir):
        return f"{adapter_dir} not found: give the output_dir of a --use_peft run."
    if os.path.isfile(os.path.join(adapter_dir, "checkpoint_complete.json")):
        return (f"{adapter_dir} is a checkpoint: export it merged with `python scripts/export_hf.py {adapter_dir} "
                f"{output_dir}`.")
    if not os.path.isfile(config_file):
        return f"{config_file} not found: give the output_dir of a --use_peft run."
    if os.path.isfile(output_dir):
        return f"{output_dir} is a file: give a new directory for the merged model."
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        return f"{output_dir} exists and is not empty: give a new directory (or remove that one first)."
    return None


def merge(adapter_dir: str, base: str, scratch: str, dtype_name: str) -> None:
    """The merged model and the tokenizer written in `scratch`, then loaded back."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.checks.model import check_weights, read_model_config
    from shardtune.config import ConfigError
    from shardtune.export.checks import model_problem, quiet_loading
    from shardtune.export.model import MAX_SHARD_SIZE, make_readable

    dtype = getattr(torch, DTYPES[dtype_name])
    if os.path.isdir(base):  # its files as a run checks them: weights whole, and the shapes config.json gives
        try:
            check_weights(base, read_model_config(base))
        except ConfigError as error:
            raise Refused(f"cannot load the base model {base} ({error.messages[0]})") from None
    try:
        with quiet_loading():  # transformers' loading report would stand above the one line that says why
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as error:
        raise Refused(f"cannot load the base model {base} ({first_line(error)}): give the base model's directory "
                      "(or Hub id) with --base.") from None
    try:
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    except (RuntimeError, ValueError, KeyError) as error:
        raise Refused(f"the adapter {adapter_dir} does not fit the base {base} ({first_line(error)}): give the base "
                      "it was trained on with --base.") from None
    merged.save_pretrained(scratch, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    tokenizer_source = adapter_dir if os.path.isfile(os.path.join(adapter_dir, "tokenizer_config.json")) else base
    AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(scratch)
    make_readable(scratch)
    problem = model_problem(scratch)
    if problem:
        raise Refused(f"the merged model would not load as what it claims: {problem}. Nothing was written.")


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="merge_lora.py",  # its refusals named so when main runs in another process's argv
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter_dir", help="a --use_peft run's output_dir (holding adapter_config.json)")
    parser.add_argument("output_dir", help="new directory for the merged Hugging Face model")
    parser.add_argument("--base", default="", help="Base model (default: adapter_config.json's); where the "
                        "recorded base is found, --base must be it unless --other_base")
    parser.add_argument("--other_base", action="store_true",
                        help="Merge into --base although adapter_config.json records another base that is found "
                             "(a copy of the base elsewhere)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="dtype of the merged weights (default: %(default)s)")
    args = parser.parse_or_exit(argv)
    output_dir = args.output_dir.rstrip("/") or "/"
    scratch = os.path.join(os.path.dirname(output_dir), f".{os.path.basename(output_dir)}.tmp")
    made = ""
    try:
        problem = input_problem(args.adapter_dir, output_dir)
        if problem:
            raise Refused(problem)
        base = base_model(args.adapter_dir, args.base, args.other_base)
        if os.path.lexists(scratch):  # not this run's: never deleted
            raise Refused(f"{scratch} already exists (a merge that did not finish, or not a merge's): remove it or "
                          "give another output directory.")
        os.makedirs(scratch)
        made = scratch  # the one directory a failed merge deletes: its own
        merge(args.adapter_dir, base, scratch, args.dtype)
    except (Refused, OSError) as error:
        if made:
            shutil.rmtree(made, ignore_errors=True)
        print(f"merge_lora: error: {error if isinstance(error, Refused) else first_line(error)}", file=sys.stderr)
        return 2
    except BaseException:  # a crash or ^C: the half merge goes, so that the next merge is not stopped by it
        if made:
            shutil.rmtree(made, ignore_errors=True)
        raise
    from shardtune.checkpoint.durable import durable, fsync_path

    durable(scratch)  # every file on disk before the output takes its name
    if os.path.isdir(output_dir):
        os.rmdir(output_dir)
    os.rename(scratch, output_dir)
    fsync_path(os.path.dirname(os.path.abspath(output_dir)))
    print(f"merge_lora: {base} + {args.adapter_dir} -> {output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

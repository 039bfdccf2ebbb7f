"""Export a training checkpoint to a Hugging Face model directory (safetensors, sharded above 5 GB).

    python scripts/export_hf.py outputs/llama8b/checkpoint-1000 exported/llama8b-step1000
    python scripts/export_hf.py outputs/llama8b_lora/checkpoint-1000 exported/llama8b-lora-merged
    python scripts/export_hf.py outputs/llama8b_lora/checkpoint-1000 exported/llama8b-lora-adapter --adapter

Works on any checkpoint the trainer writes: DDP / single process (model.safetensors), FSDP sharded state
(torch.distributed.checkpoint), and DeepSpeed ZeRO partitions (DeepSpeed's zero_to_fp32, fp32 master weights),
with or without --save_only_model. FSDP and ZeRO checkpoints are converted shard by shard: at most one output
shard is held in memory. A LoRA run's checkpoint is written as the merged model (the base model's class, the
adapter merged into its weights), or with --adapter as the adapter alone, in peft's format.
A checkpoint that does not match its marker (a file missing or cut short) is refused. What is written is loaded
back before it takes its name (the weights' names and shapes against the model class, or peft's adapter, that
its config claims): a mismatch is refused. The export is written under a temporary name, fsynced, then renamed:
it appears whole or not at all. Its files get the mode any new file gets (0644 under umask 022).

The weights are written in the dtype the checkpoint's config.json states (the trainer writes there the run's
--save_dtype: by default the model's own, bf16 for the Llama recipes), cast shard by shard; `--dtype fp32` (or
bf16, fp16) asks for another. The config.json written states the dtype of the weights written. An adapter is
written as trained (fp32) unless --dtype names another.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

# The standard library only until the input is checked: a wrong path is answered before torch loads (seconds).
from shardtune.checkpoint.durable import durable, fsync_path
from shardtune.checkpoint.markers import MARKER, complete_checkpoints, damage
from shardtune.checks.command_line import OneLineParser

DTYPES = ("bf16", "fp16", "fp32")  # shardtune.export.model.EXPORT_DTYPES, named here without importing torch


class Refused(Exception):
    """Bad input: the message names the problem and the fix."""


def input_problem(checkpoint: Path, output: Path) -> str | None:
    """Why `checkpoint` cannot be exported to `output`, with what to give instead; None if it can."""
    if not checkpoint.exists():
        return f"{checkpoint} not found: give a checkpoint-<step> directory of a run's output_dir."
    if not (checkpoint / MARKER).is_file():
        return not_a_checkpoint(checkpoint)
    problem = damage(str(checkpoint))
    if problem:
        return f"{checkpoint} is damaged: {problem}. Export an earlier checkpoint."
    if not (checkpoint / "config.json").is_file():
        return (f"{checkpoint} holds no config.json (the model's, which checkpoints hold since exports read it): "
                "copy the trained model's config.json into it and export again.")
    resolved_output, resolved_checkpoint = output.resolve(), checkpoint.resolve()
    if resolved_output == resolved_checkpoint or resolved_checkpoint in resolved_output.parents:
        return f"{output} is inside the checkpoint {checkpoint}: give a directory outside it."
    if output.exists() and not output.is_dir():
        return f"{output} is a file: give a new directory for the export."
    if output.exists() and any(output.iterdir()):
        return f"{output} exists and is not empty: give a new directory (or remove that one first)."
    return None


def not_a_checkpoint(path: Path) -> str:
    """What a directory without a completion marker is, and what to give instead."""
    if not path.is_dir():
        return f"{path} is a file, not a checkpoint: give a checkpoint-<step> directory of a run's output_dir."
    complete = complete_checkpoints(str(path))
    if complete:
        return (f"{path} is a run's output_dir, not a checkpoint: give one of its checkpoints, e.g. {complete[-1]} "
                "(the newest complete one).")
    if (path / "adapter_config.json").is_file():
        return (f"{path} is a LoRA adapter, not a checkpoint: merge it into its base with "
                f"`python scripts/merge_lora.py {path} <new directory>`.")
    if re.fullmatch(r"\.?checkpoint-\d+(\.tmp)?", path.name):
        newest = complete_checkpoints(str(path.parent))
        instead = f"export the newest complete one, {newest[-1]}" if newest else "export a complete checkpoint"
        return f"{path} is not a complete checkpoint (no {MARKER}): its save did not finish; {instead}."
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return (f"{path} is already a Hugging Face model directory (no {MARKER}): load it with from_pretrained; "
                "export_hf.py converts a run's checkpoint-<step> directories.")
    return f"{path} is not a checkpoint (no {MARKER}): give a checkpoint-<step> directory of a run's output_dir."


def write(checkpoint: Path, scratch: Path, dtype_name: str, adapter: bool) -> str:
    """Export into `scratch`, then check that it loads as what it claims. Returns what was written."""
    from transformers import AutoConfig  # the libraries load here, after the input checks

    from shardtune.export.checkpoint import ExportError, export, stated_dtype
    from shardtune.export.checks import adapter_problem, model_problem
    from shardtune.export.model import EXPORT_DTYPES, make_readable

    dtype = (None if adapter else stated_dtype(checkpoint)) if dtype_name == "auto" else EXPORT_DTYPES[dtype_name]
    try:
        written = export(checkpoint, scratch, dtype, adapter)
    except ExportError as error:
        raise Refused(str(error)) from None
    make_readable(str(scratch), recursive=True)
    problem = (adapter_problem(scratch, AutoConfig.from_pretrained(checkpoint)) if written == "adapter"
               else model_problem(scratch))
    if problem:
        raise Refused(f"the export of {checkpoint} would not load as what it claims: {problem}. Nothing was written; "
                      "report this with the checkpoint's file list.")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-<step> directory")
    parser.add_argument("output", type=Path, help="new directory for the Hugging Face model")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="dtype of the weights written; auto: the one the checkpoint's config.json states (the "
                             "run's --save_dtype, by default the model's own); an adapter's: as trained")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run's checkpoint: write its adapter alone (peft's format, loads with "
                             "PeftModel.from_pretrained on the base) instead of the merged model")
    args = parser.parse_or_exit(argv)
    problem = input_problem(args.checkpoint, args.output)
    if problem:
        sys.exit(refusal(problem))
    scratch = args.output.with_name(f".{args.output.name}.tmp")
    try:  # made here, never there before: the one directory a failed export deletes is its own
        args.output.parent.mkdir(parents=True, exist_ok=True)
        scratch.mkdir()
    except FileExistsError:
        sys.exit(refusal(f"{scratch} already exists (an export that did not finish, or not an export's): remove it "
                         "or give another output directory."))
    except OSError as error:
        sys.exit(refusal(f"cannot create {scratch} ({error.strerror}): give an output directory you can write to."))
    try:
        written = write(args.checkpoint, scratch, args.dtype, args.adapter)
    except Refused as error:
        shutil.rmtree(scratch, ignore_errors=True)
        sys.exit(refusal(str(error)))
    except BaseException:  # a crash or ^C: the half export goes, so that the next export is not stopped by it
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    durable(str(scratch))  # every file on disk before the output takes its name: a crash leaves no half model
    if args.output.exists():
        args.output.rmdir()  # empty (input_problem): the export takes its place; a file put there since stops it
    os.rename(scratch, args.output)  # the output appears only when complete
    fsync_path(str(args.output.parent))  # and the rename survives a crash too
    print(f"export_hf: wrote {args.output} (the {written})")


def refusal(message: str) -> int:
    """One line on stderr; the exit code of a refusal (2)."""
    print(f"export_hf: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    main()

"""What a run writes into its output directory, and deleting only that: --overwrite_output_dir's clearing, and a
checkpoint's removal (rotation past --save_total_limit, a save redone). Anything else found there, hidden or not,
is a stranger's: the directory is refused rather than emptied, the checkpoint kept."""

from __future__ import annotations

import contextlib
import os
import re
import sys

from shardtune.checkpoint.markers import (
    CHECKPOINT_NAME,
    CONVERTED_NAME,
    CONVERTED_SCRATCH,
    MARKER,
    SCRATCH_NAME,
    described,
    foreign_checkpoints,
    foreign_checkpoints_note,
    holds_a_run,
    read_marker,
)
from shardtune.checkpoint.output_dir import LOCK_FILE, METRICS_FILE, RUN_CONFIG_FILE, SAMPLES_FILE

# What a run writes into its output directory: the one list --overwrite_output_dir deletes from.
RUN_FILES = frozenset({
    LOCK_FILE, METRICS_FILE, SAMPLES_FILE, RUN_CONFIG_FILE,
    "wandb_run_id",  # shardtune.tracking: the W&B run a resumed run continues
    "metrics.png",  # scripts/plot_metrics.py's default
    # The final export (shardtune.export.model.save_hf_model): save_pretrained's and the tokenizer's files, or peft's.
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "adapter_model.safetensors", "adapter_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
})
# The folders a run writes, and the names written at their top (kind: "file", "dir" or "link"); anything else in
# one makes the folder a stranger's. What lies below those names is their writer's (W&B's run folders).
RUN_DIRECTORIES: dict[str, tuple[tuple[re.Pattern, str], ...]] = {
    # wandb 0.31 (sdk/wandb_settings.py, wandb_init.py) under wandb.init's dir, the output directory: each run's
    # folder `{run|offline-run}-<%Y%m%d_%H%M%S>-<run id>[-suffix]`, and the links to the latest run and its logs,
    # each made under a temporary `<name>.<pid>` and renamed (_safe_symlink).
    "wandb": ((re.compile(r"(offline-)?run-\d{8}_\d{6}-.+"), "dir"),
              (re.compile(r"(latest-run|debug\.log|debug-internal\.log)(\.\d+)?"), "link")),
    # shardtune.methods.reference: DPO's cached reference log-probs, <split>.pt and <split>.json per split (train,
    # eval), each written as <name>.tmp and renamed.
    "reference_log_probs": ((re.compile(r"(train|eval)\.(pt|json)(\.tmp)?"), "file"),),
    # a tokenizer's named chat templates, as save_pretrained writes them: <name>.jinja
    "additional_chat_templates": ((re.compile(r"[^.].*\.jinja"), "file"),),
}
RUN_PATTERNS = (
    re.compile(r"model-\d{5}-of-\d{5}\.safetensors"),  # the export's shards
    re.compile(r"\.shardtune-shared-[0-9a-f]{32}"),  # shardtune.parallel.ranks: the probe of a shared filesystem
)
PEFT_MODEL_CARD = "README.md"  # peft's save_pretrained writes a model card; a README of one's own is not the run's


def run_entry(output_dir: str, name: str) -> bool:
    """Whether `output_dir/name` is something a run writes there. A checkpoint that carries its marker must hold
    only the files the marker lists (a file added to it is a stranger's); one without a marker is the run's only
    beside the run's lock (else another trainer's: foreign_checkpoints). A run's folder must hold only the names
    its writer puts there."""
    path = os.path.join(output_dir, name)
    if os.path.islink(path):
        return False  # a run writes no links: deleting one would not delete what it points to, but it is not ours
    if name in RUN_FILES:
        return os.path.isfile(path)
    if name in RUN_DIRECTORIES:
        return os.path.isdir(path) and not folder_strangers(path, RUN_DIRECTORIES[name])
    if name == PEFT_MODEL_CARD:
        return os.path.isfile(path) and is_peft_model_card(path)
    if CONVERTED_NAME.match(name) or CONVERTED_SCRATCH.match(name):  # a conversion for a resume: marked as a save
        return os.path.isdir(path) and os.path.isfile(os.path.join(output_dir, LOCK_FILE)) and (
            CONVERTED_SCRATCH.match(name) is not None or (os.path.isfile(os.path.join(path, MARKER))
                                                          and not checkpoint_strangers(path)))
    if CHECKPOINT_NAME.match(name) or SCRATCH_NAME.match(name):
        if not os.path.isdir(path):
            return False
        if not os.path.isfile(os.path.join(path, MARKER)):
            return os.path.isfile(os.path.join(output_dir, LOCK_FILE))
        return not checkpoint_strangers(path)
    return any(pattern.fullmatch(name) for pattern in RUN_PATTERNS) and os.path.isfile(path)


def folder_strangers(folder: str, written: tuple[tuple[re.Pattern, str], ...]) -> list[str]:
    """The names at the top of a run's folder that its writer does not write there (`written`), sorted."""
    found = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        kind = "link" if os.path.islink(path) else "dir" if os.path.isdir(path) else "file"
        if not any(pattern.fullmatch(name) and kind == expected for pattern, expected in written):
            found.append(name)
    return sorted(found)


def is_peft_model_card(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            head = file.read(4096)
    except OSError:
        return False
    front = head.split("---")[1] if head.startswith("---") and head.count("---") >= 2 else ""
    return re.search(r"^library_name:\s*peft\s*$", front, re.MULTILINE) is not None


def checkpoint_strangers(checkpoint: str) -> list[str]:
    """Files in a checkpoint that its save did not write: not in the file list of its marker. A checkpoint
    without a marker (its save did not finish) or with a marker written before files were listed is the run's
    by its name."""
    try:
        listed = read_marker(checkpoint).get("files")
    except (OSError, ValueError):
        return []
    if listed is None:
        return []
    found = []
    for directory, folders, names in os.walk(checkpoint):
        for name in names + [folder for folder in folders if os.path.islink(os.path.join(directory, folder))]:
            relative = os.path.relpath(os.path.join(directory, name), checkpoint)
            if relative not in listed and relative != MARKER:
                found.append(relative)
    return sorted(found)


def strangers(output_dir: str) -> list[str]:
    """What `output_dir` holds that no run wrote (hidden names included), sorted; [] for a missing directory."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(name for name in os.listdir(output_dir) if not run_entry(output_dir, name))


def stranger_paths(output_dir: str) -> list[str]:
    """strangers(), each run folder or marked checkpoint among them named by what no run wrote inside it
    (`wandb/notes.tex`), for a line that says what to move out."""
    found = []
    for name in strangers(output_dir):
        path = os.path.join(output_dir, name)
        inside = []
        if os.path.isdir(path) and not os.path.islink(path):
            if name in RUN_DIRECTORIES:
                inside = folder_strangers(path, RUN_DIRECTORIES[name])
            elif CHECKPOINT_NAME.match(name) or SCRATCH_NAME.match(name):
                inside = checkpoint_strangers(path)
        found += [f"{name}/{inner}" for inner in inside] or [name]
    return found


def never_cleared(output_dir: str) -> str | None:
    """Why `output_dir` is a place --overwrite_output_dir must never empty, whatever it holds now: a home
    directory, the filesystem's root, a repository's root, or the working directory or one above it. None where
    none of these."""
    target = os.path.realpath(output_dir)
    home = os.path.realpath(os.path.expanduser("~"))
    here = os.path.realpath(os.getcwd())
    if target == home:
        return "is the home directory"
    if target == os.path.dirname(target):  # a volume mounted as the run's own directory is fine: strangers() guards it
        return "is the root of the filesystem"
    if os.path.lexists(os.path.join(target, ".git")):
        return "is the root of a repository (it holds .git)"
    if target == here:
        return "is the working directory"
    if os.path.commonpath([target, here]) == target:
        return "holds the working directory"
    return None


def clear_problem(output_dir: str) -> str | None:
    """Why --overwrite_output_dir true must not clear `output_dir` (one line: the problem and the fix), or None."""
    if not os.path.isdir(output_dir):
        return None
    place = never_cleared(output_dir)
    if place:
        return (f"--overwrite_output_dir true clears --output_dir {output_dir!r}, which {place}: it is never "
                "cleared. Give --output_dir a directory of the run's own (e.g. outputs/<name>).")
    foreign = foreign_checkpoints(output_dir)
    found = [path for path in stranger_paths(output_dir) if path not in foreign]
    others = f"{len(found)} entr{'y' if len(found) == 1 else 'ies'} no run wrote ({described(found)})"
    if foreign:
        return (f"--overwrite_output_dir true deletes only what a shardtune run wrote, and "
                f"{foreign_checkpoints_note(output_dir, foreign)}{f'; it also holds {others}' if found else ''}. "
                "Give --output_dir a directory of the run's own.")
    if found:
        return (f"--overwrite_output_dir true deletes only what a run writes, and --output_dir {output_dir!r} also "
                f"holds {others}: move them out, or give --output_dir a directory of the run's own.")
    entries = sorted(os.listdir(output_dir))
    if entries and not holds_a_run(output_dir):  # a model directory has an export's names, and no run's lock
        return (f"--overwrite_output_dir true replaces an earlier run, and --output_dir {output_dir!r} holds none (no "
                f"{LOCK_FILE}, no checkpoint with {MARKER}) but {described(entries)}: give --output_dir a directory "
                "of the run's own.")
    return None


def clear_output_dir(output_dir: str) -> list[str]:
    """--overwrite_output_dir: remove an earlier run's files, all but the lock this run holds; nothing else. The
    start-up checks refused a directory holding anything else (clear_problem); whatever appeared there since is
    kept, said in one line, and returned."""
    import shutil

    if not os.path.isdir(output_dir) or never_cleared(output_dir):
        return []  # refused at start-up; a directory that became one since is left as it is
    kept = []
    for name in sorted(os.listdir(output_dir)):
        if name == LOCK_FILE:
            continue
        if not run_entry(output_dir, name):
            kept.append(name)
            continue
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    if kept:
        print(f"shardtune: warning: --overwrite_output_dir true kept {described(kept)} in {output_dir}: no run wrote "
              f"{'it' if len(kept) == 1 else 'them'}.", file=sys.stderr, flush=True)
    return kept


def remove_checkpoint(checkpoint: str) -> str | None:
    """Delete a checkpoint directory of this run (rotation past --save_total_limit, an unfinished save redone):
    only when it holds nothing but its save's files. Otherwise nothing is deleted and the reason is returned (a
    line naming what is kept and the fix)."""
    import shutil

    if os.path.lexists(checkpoint):
        name = os.path.basename(os.path.normpath(checkpoint))
        if not os.path.isdir(checkpoint) or os.path.islink(checkpoint) or not (
                CHECKPOINT_NAME.match(name) or SCRATCH_NAME.match(name) or CONVERTED_NAME.match(name)):
            return f"{checkpoint} is not a checkpoint directory a save wrote: kept; move it out of --output_dir."
        found = checkpoint_strangers(checkpoint)
        if found:
            return (f"{checkpoint} holds {described(found)}, which its save did not write: kept whole; move "
                    f"{'it' if len(found) == 1 else 'them'} out and delete the checkpoint yourself.")
    try:
        shutil.rmtree(checkpoint)
    except FileNotFoundError:
        return None  # nothing there (the usual case of a save's scratch): nothing to delete
    except OSError as error:
        return f"{checkpoint} could not be deleted ({error.strerror}): delete it yourself."
    return None


def remove_conversions(output_dir: str, before_step: int) -> list[str]:
    """Delete the universal forms of other directories' checkpoints (`universal-checkpoint-<step>`) converted
    here for a resume, once the run has saved a checkpoint of its own past them (rotation keeps the run's last
    --save_total_limit, and a conversion is 12 bytes per parameter). Only a finished conversion (renamed into place
    with its marker) is the run's; one without a marker, or holding a stranger's file, is kept: the lines returned
    say why."""
    kept = []
    for name in sorted(os.listdir(output_dir)):
        match = CONVERTED_NAME.match(name)
        if not match or int(match.group(1)) >= before_step:
            continue
        path = os.path.join(output_dir, name)
        if not os.path.isfile(os.path.join(path, MARKER)):
            kept.append(f"{path} has no {MARKER}, so no conversion of this run wrote it: kept.")
        elif reason := remove_checkpoint(path):
            kept.append(reason)
    return kept

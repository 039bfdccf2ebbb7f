"""A checkpoint's completion marker (`checkpoint_complete.json`: step, world size, every file with its size and
the small ones' checksums), and finding a checkpoint to resume from against it.

Neither torch nor accelerate is imported here: the command line resolves --resume_from_checkpoint, and reports a
bad one, before it imports them (seconds)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys

from shardtune.checkpoint.durable import fsync_path
from shardtune.checkpoint.output_dir import LOCK_FILE
from shardtune.config import ConfigError
from shardtune.parallel.local_rank import first_on_machine

MARKER = "checkpoint_complete.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
SCRATCH_NAME = re.compile(r"^\.checkpoint-(\d+)\.tmp$")  # a save being written (saver.py)
# Another directory's DeepSpeed checkpoint converted into this run's to resume on another size (universal.py).
CONVERTED_NAME = re.compile(r"^universal-checkpoint-(\d+)$")
CONVERTED_SCRATCH = re.compile(r"^\.universal-checkpoint-(\d+)\.tmp$")
CHECKSUM_MAX_BYTES = 1 << 20  # small files (configs, RNG and scheduler states) are cheap to checksum


# ---------------------------------------------------------------------------------------------------- marking


def describe_files(checkpoint: str) -> dict[str, dict]:
    """Every file of a checkpoint but its marker: size, and sha256 where the file is small."""
    files = {}
    for directory, _, names in os.walk(checkpoint):
        for name in names:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, checkpoint)
            if relative in (MARKER, MARKER + ".tmp") or os.path.islink(path):
                continue
            size = os.path.getsize(path)
            files[relative] = {"bytes": size, **({"sha256": sha256(path)} if size <= CHECKSUM_MAX_BYTES else {})}
    return dict(sorted(files.items()))


def sha256(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def write_marker(checkpoint: str, content: dict) -> None:
    path = os.path.join(checkpoint, MARKER)
    with open(path + ".tmp", "w") as file:
        json.dump(content, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.rename(path + ".tmp", path)
    fsync_path(checkpoint)


def read_marker(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, MARKER)) as file:
        return json.load(file)


# ------------------------------------------------------------------------------------------ finding and checking


def checkpoint_step(path: str) -> int:
    match = CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else -1


def complete_checkpoints(output_dir: str) -> list[str]:
    """Complete (marked) checkpoints in `output_dir`, oldest first. Marked is not yet checked: see `damage`."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_NAME.match(name)
        if match and os.path.isfile(os.path.join(output_dir, name, MARKER)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def damage(checkpoint: str) -> str | None:
    """Why a marked checkpoint cannot be trusted (a file missing, of another size or checksum than its marker
    records), or None. Markers written before files were listed are trusted as they are."""
    try:
        files = read_marker(checkpoint).get("files")
    except (OSError, ValueError) as error:
        return f"its {MARKER} cannot be read ({error})"
    problems = []
    for name, expected in (files or {}).items():
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) != expected["bytes"]:
            problems.append(f"{name} has {os.path.getsize(path):,} bytes, {expected['bytes']:,} when saved")
        elif "sha256" in expected and sha256(path) != expected["sha256"]:
            problems.append(f"{name} differs from what was saved (sha256)")
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else "")


def warn(message: str) -> None:
    """One line on stderr from the first rank of each machine, so that each machine's log says it once."""
    if first_on_machine():
        print(f"shardtune: warning: {message}", file=sys.stderr, flush=True)


def newest_usable(output_dir: str) -> str | None:
    """The newest complete checkpoint that matches its marker and can resume training; each one skipped is
    named in one warning line."""
    skipped = False
    for checkpoint in reversed(complete_checkpoints(output_dir)):
        problem = damage(checkpoint)
        if problem:
            warn(f"{checkpoint} is damaged: {problem}; resuming from the checkpoint before it.")
        elif read_marker(checkpoint).get("model_only"):
            warn(f"{checkpoint} was saved with --save_only_model true and cannot resume training; skipped.")
        else:
            return checkpoint
        skipped = True
    if skipped:
        warn(f"no checkpoint in {output_dir} can resume training: starting from step 0.")
    return None


def holds_a_run(output_dir: str) -> bool:
    """A shardtune run was started in `output_dir`: it holds the lock every run takes before writing anything (and
    never removes), or a checkpoint carrying shardtune's marker. A `checkpoint-<step>` folder alone is no sign: a
    Hugging Face Trainer or TRL run names its checkpoints the same way."""
    if not os.path.isdir(output_dir):
        return False
    return os.path.isfile(os.path.join(output_dir, LOCK_FILE)) or bool(complete_checkpoints(output_dir))


def foreign_checkpoints(output_dir: str) -> list[str]:
    """The checkpoint-named folders of `output_dir` that no shardtune run wrote: without a marker, in a directory
    no run locked (another trainer's, or copied in), sorted. [] where the lock is there: then an unmarked one is
    a save of the run's that did not finish."""
    if not os.path.isdir(output_dir) or os.path.isfile(os.path.join(output_dir, LOCK_FILE)):
        return []
    found = []
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if (CHECKPOINT_NAME.match(name) or SCRATCH_NAME.match(name)) and os.path.isdir(path) and \
                not os.path.islink(path) and not os.path.isfile(os.path.join(path, MARKER)):
            found.append(name)
    return sorted(found)


def described(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")


def foreign_checkpoints_note(output_dir: str, names: list[str]) -> str:
    """What `names` (foreign_checkpoints) are, for a one-line refusal that adds its fix."""
    return (f"--output_dir {output_dir!r} holds {described(names)} with no {MARKER} and no {LOCK_FILE} beside "
            f"{'it' if len(names) == 1 else 'them'}: another trainer's checkpoints, which shardtune neither resumes "
            "nor deletes")


def not_a_checkpoint(path: str) -> str:
    """Why `path`, a directory without a marker, cannot be resumed from, and what to give instead."""
    normal = os.path.normpath(path)
    name, parent = os.path.basename(normal), os.path.dirname(normal) or "."
    if CHECKPOINT_NAME.match(name) or SCRATCH_NAME.match(name):
        if name in foreign_checkpoints(parent):
            return (f"--resume_from_checkpoint {path!r} is not a shardtune checkpoint (no {MARKER}, and no "
                    f"{LOCK_FILE} in {parent!r}): another trainer's checkpoint cannot be resumed. Start a new run in "
                    f"a new --output_dir (from its weights, where it holds a config.json: --model_name_or_path "
                    f"{path}).")
        return (f"--resume_from_checkpoint {path!r} is not a complete checkpoint (no {MARKER}): its save did not "
                "finish. Give an earlier checkpoint, or `auto` for the newest complete one.")
    inside = complete_checkpoints(path)
    if inside or holds_a_run(path):
        newest = f" (the newest complete one is {inside[-1]})" if inside else ""
        return (f"--resume_from_checkpoint {path!r} is a run's output directory, not a checkpoint: give one of its "
                f"checkpoint-<step> directories{newest}, or `auto` with --output_dir {path}.")
    foreign = foreign_checkpoints(path)
    if foreign:
        return (f"--resume_from_checkpoint {path!r} is not a checkpoint, and "
                + foreign_checkpoints_note(path, foreign).removeprefix(f"--output_dir {path!r} ")
                + ". Start a new run in a new --output_dir.")
    return (f"--resume_from_checkpoint {path!r} is not a checkpoint (no {MARKER}, not named checkpoint-<step>): "
            "give <output_dir>/checkpoint-<step>, or `auto` for the newest complete one in --output_dir.")


def resolve_resume(resume_from: str, output_dir: str, world_size: int) -> tuple[str | None, int]:
    """(checkpoint path, step) to resume from; (None, 0) to start fresh. Raises ConfigError before any loading.
    `auto` where a run was started but saved no checkpoint starts it again from step 0, said in a line (a
    requeued job that had not saved yet); where no run was ever started, it is refused (a mistyped --output_dir)."""
    if not resume_from:
        return None, 0
    if resume_from == "auto":
        checkpoint = newest_usable(output_dir)
        if checkpoint is None:
            foreign = foreign_checkpoints(output_dir)
            if foreign:
                raise ConfigError(f"--resume_from_checkpoint auto found nothing to resume: "
                                  f"{foreign_checkpoints_note(output_dir, foreign)}. Drop --resume_from_checkpoint "
                                  "and give --output_dir a new directory.")
            if not holds_a_run(output_dir):
                where = "does not exist" if not os.path.exists(output_dir) else "holds no run"
                raise ConfigError(f"--resume_from_checkpoint auto found nothing to resume: --output_dir {output_dir!r} "
                                  f"{where}. Check the path, or drop --resume_from_checkpoint to start a new run.")
            if not complete_checkpoints(output_dir):
                warn(f"--resume_from_checkpoint auto: the run in {output_dir} saved no checkpoint: starting it again "
                     "from step 0.")
            return None, 0
    else:
        checkpoint = resume_from
        if not os.path.isfile(os.path.join(checkpoint, MARKER)):
            raise ConfigError(not_a_checkpoint(checkpoint))
        problem = damage(checkpoint)
        if problem:
            raise ConfigError(f"--resume_from_checkpoint {checkpoint!r} is damaged: {problem}. Give an earlier "
                              "checkpoint, or `auto` for the newest undamaged one.")
        if read_marker(checkpoint).get("model_only"):
            raise ConfigError(f"--resume_from_checkpoint {checkpoint!r} was saved with --save_only_model true: it "
                              "holds no optimizer state to resume from. Export it with scripts/export_hf.py and "
                              "start a new run from the export.")
    marker = read_marker(checkpoint)
    if marker["world_size"] != world_size and "strategy" not in marker:
        # Another number of processes is judged by the strategy that saved it (run_settings.resume_point); a
        # marker that does not record it cannot tell.
        raise ConfigError(
            f"Checkpoint {checkpoint!r} was saved by {marker['world_size']} processes and this run has {world_size}; "
            f"its marker does not say under which strategy, which decides whether its states load on another "
            f"number. Resume with --num_processes {marker['world_size']}, or export it with scripts/export_hf.py and "
            "start a new run."
        )
    return checkpoint, marker["step"]

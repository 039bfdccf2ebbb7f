"""The run's output directory: the lock that makes it one live run's, the names of the files every run writes
there, and clearing it for --overwrite_output_dir.

Rank 0 holds an exclusive `flock` on `<output_dir>/.shardtune-lock` from before anything is written until the
process ends. The kernel releases a flock when its process dies, however it dies (on NFS, once the server's lease
of a crashed machine runs out, 90 s by default), so a run that is gone never blocks the next. The file says who
holds it (machine, process, start, command) and is emptied at a clean exit: a file that still names a holder when
its lock is free was left by a run that died, and the next run takes it over with a line saying so. The file
itself is never removed (a lock on a removed file would let a third run lock a new file of the same name).

Standard library only: the command line takes the lock before it imports torch."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import sys
import time

from shardtune.config import ConfigError

LOCK_FILE = ".shardtune-lock"
METRICS_FILE = "metrics.jsonl"
ACQUIRE_PATIENCE_S = 2.0  # another launch's rank 0 may be probing the lock at this very moment
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a filesystem without flock


def is_rank_zero() -> bool:
    """The process that holds the lock: global rank 0 (a run without RANK is one process)."""
    return os.environ.get("RANK", "0").strip() == "0"


def describe_holder(path: str) -> str:
    """"pid 1234 on gpu-node-3, started 2026-12-06 03:50:12 UTC: recipes/tiny.py ...", or "" for an empty file."""
    try:
        with open(path) as file:
            holder = json.load(file)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: {holder['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def in_use(output_dir: str) -> str | None:
    """Who holds `output_dir` now ("pid ... on ..."), or None when no live run does. Probes without taking the
    lock: a shared lock, let go at once."""
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return describe_holder(path) or "a run that has not yet said who it is"
    except OSError:
        return None  # a filesystem without locks: OutputDirLock.acquire says so
    finally:
        os.close(fd)  # releases the probe's lock
    return None


def in_use_message(output_dir: str, holder: str, overwrite: bool) -> str:
    why = " (--overwrite_output_dir never touches a live run's files)" if overwrite else ""
    return (f"--output_dir {output_dir!r} is in use by a live run ({holder}){why}: wait for it to end, stop it, or "
            "give another --output_dir.")


class OutputDirLock:
    """The lock of one output directory, held by this process until `release` (registered at exit)."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self, overwrite: bool) -> str | None:
        """Take the lock or raise ConfigError naming the live run that holds it. Returns a line to print when a
        dead run's lock was taken over, or when the filesystem takes no locks."""
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigError(f"--output_dir {os.path.dirname(self.path)!r} cannot be written ({error.strerror}): "
                              "give a directory this user can write.") from None
        deadline = time.monotonic() + ACQUIRE_PATIENCE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                os.close(fd)
                holder = describe_holder(self.path) or "a run that has not yet said who it is"
                raise ConfigError(in_use_message(os.path.dirname(self.path), holder, overwrite)) from None
            except OSError as error:
                os.close(fd)
                if error.errno not in UNSUPPORTED:
                    raise
                return (f"the filesystem of {os.path.dirname(self.path)!r} takes no locks ({error.strerror}): "
                        "nothing stops a second run from writing into it at the same time.")
        self.fd = fd
        left = describe_holder(self.path)
        self.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "command": " ".join(sys.argv)}))
        atexit.register(self.release)
        if left:
            return (f"--output_dir {os.path.dirname(self.path)!r} was held by a run that ended without closing "
                    f"({left}); taking it over.")
        return None

    def write(self, text: str) -> None:
        assert self.fd is not None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Empty the file (a clean end) and let the lock go."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.write("")
        os.close(self.fd)  # releases the flock
        self.fd = None


# ---------------------------------------------------------------------------------------------------------------
# What a run writes into its output directory: the one list --overwrite_output_dir deletes from. Anything else found
# there (hidden or not) is a stranger's, and the directory is refused rather than emptied.

SAMPLES_FILE = "samples.jsonl"  # shardtune.tracking: generated samples at each eval
RUN_CONFIG_FILE = "run_config.json"  # shardtune.tracking: the resolved recipe and launch
RUN_FILES = frozenset({
    LOCK_FILE, METRICS_FILE, SAMPLES_FILE, RUN_CONFIG_FILE,
    "wandb_run_id",  # shardtune.tracking: the W&B run a resumed run continues
    "metrics.png",  # scripts/plot_metrics.py's default
    # The final export (shardtune.export.save_hf_model): save_pretrained's and the tokenizer's files, or peft's.
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "adapter_model.safetensors", "adapter_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
})
RUN_DIRECTORIES = frozenset({
    "wandb",  # W&B's own files (wandb.init's dir is the output directory)
    "reference_log_probs",  # shardtune.methods.reference: DPO's cached reference log-probabilities
    "additional_chat_templates",  # a tokenizer's named chat templates, as save_pretrained writes them
})
RUN_PATTERNS = (
    re.compile(r"checkpoint-\d+"),  # shardtune.checkpoint: a save (checked against its marker: run_entry)
    re.compile(r"\.checkpoint-\d+\.tmp"),  # a save being written, or left by a crash
    re.compile(r"model-\d{5}-of-\d{5}\.safetensors"),  # the export's shards
    re.compile(r"\.shardtune-shared-[0-9a-f]{32}"),  # shardtune.ranks: the probe of a shared filesystem
)
PEFT_MODEL_CARD = "README.md"  # peft's save_pretrained writes a model card; a README of one's own is not the run's


def run_entry(output_dir: str, name: str) -> bool:
    """Whether `output_dir/name` is something a run writes there. A checkpoint that carries its marker must hold
    only the files the marker lists (a file added to it is a stranger's)."""
    path = os.path.join(output_dir, name)
    if os.path.islink(path):
        return False  # a run writes no links: deleting one would not delete what it points to, but it is not ours
    if name in RUN_FILES:
        return os.path.isfile(path)
    if name in RUN_DIRECTORIES:
        return os.path.isdir(path)
    if name == PEFT_MODEL_CARD:
        return os.path.isfile(path) and is_peft_model_card(path)
    if RUN_PATTERNS[0].fullmatch(name):
        return os.path.isdir(path) and not checkpoint_strangers(path)
    return any(pattern.fullmatch(name) for pattern in RUN_PATTERNS[1:])


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
    from shardtune.checkpoint.markers import MARKER, read_marker  # markers imports this module

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


def described(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (f" and {len(names) - count} more" if len(names) > count else "")


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
    found = strangers(output_dir)
    if found:
        return (f"--overwrite_output_dir true deletes only what a run writes, and --output_dir {output_dir!r} also "
                f"holds {len(found)} entr{'y' if len(found) == 1 else 'ies'} no run wrote ({described(found)}): move "
                "them out, or give --output_dir a directory of the run's own.")
    from shardtune.checkpoint.markers import holds_a_run  # markers imports this module

    entries = sorted(os.listdir(output_dir))
    if entries and not holds_a_run(output_dir):  # a model directory has an export's names, and no run's lock
        return (f"--overwrite_output_dir true replaces an earlier run, and --output_dir {output_dir!r} holds none (no "
                f"{LOCK_FILE}, {METRICS_FILE} or checkpoint) but {described(entries)}: give --output_dir a directory "
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
        if not os.path.isdir(checkpoint) or os.path.islink(checkpoint) or not any(
                pattern.fullmatch(name) for pattern in RUN_PATTERNS[:2]):
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

"""Writes that survive a crash of this machine: fsync of files, directories and trees. The standard library
only: markers.py, which the command line imports before torch, uses it."""

from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """fsync one file or directory (a directory's fsync makes the names created or renamed in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable(path: str, recursive: bool = True) -> None:
    """Make `path` survive a crash of this machine: fsync it (a directory: every file under it, or only its own
    files with `recursive=False`, and the directories), then the directory that holds it."""
    if os.path.isdir(path) and recursive:
        fsync_tree(path)
    elif os.path.isdir(path):
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                fsync_path(entry.path)
        fsync_path(path)
    else:
        fsync_path(path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def fsync_tree(root: str) -> None:
    """fsync every file and directory under `root`, children before parents. An fsync writes back the file's
    dirty pages in this machine's page cache whoever wrote them, so a rank that syncs the whole tree after its
    own writes has made its own files durable, whatever the other ranks are doing."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            try:
                if not os.path.islink(path):
                    fsync_path(path)
            except FileNotFoundError:  # another rank's temporary file, renamed since: its writer syncs it
                pass
        fsync_path(directory)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of `data` to `fd`, in pieces of at most 1 GiB (os.write may write less than it is given)."""
    view, written = memoryview(data).cast("B"), 0
    while written < len(view):
        written += os.write(fd, view[written:written + (1 << 30)])  # the GIL is released while it writes

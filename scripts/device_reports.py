"""gpu_check's three result files, the ones that come back from the device tool's $OUT: --out (JSON Lines),
--table and --archive, written as each case ends and again on SIGTERM."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
from pathlib import Path

from shardtune.gpu_check_figures import append_jsonl, print_table


class Reporter:
    """The three files that come back from the device: --out (a JSON line per row and comparison, appended as each
    ends), --table (the table as printed) and --archive (a tar.gz of --log_dir's logs), the last two rewritten
    whole, each through a temporary file, so that a kill at any moment leaves the previous complete one."""

    def __init__(self, args) -> None:
        self.out, self.table, self.archive, self.log_dir = args.out, args.table, args.archive, Path(args.log_dir)

    def append(self, record: dict) -> None:
        append_jsonl(self.out, record)

    def write(self, rows: list[dict], comparisons: list[dict]) -> None:
        if self.table:
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                print_table(rows, comparisons)
            replace_file(Path(self.table), text.getvalue().encode())
        if self.archive:
            packed = io.BytesIO()
            with tarfile.open(fileobj=packed, mode="w:gz") as archive:
                for path in sorted(self.log_dir.glob("*")):
                    if path.suffix in (".log", ".jsonl", ".json"):
                        archive.add(path, arcname=f"gpu-check/{path.name}")
            replace_file(Path(self.archive), packed.getvalue())


def replace_file(path: Path, content: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(content)
    os.replace(partial, path)

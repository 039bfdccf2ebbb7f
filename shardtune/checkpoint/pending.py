"""One save between its start and its marker: the files still to write from host memory, the
torch.distributed.checkpoint writes in flight, and the fsync of the whole tree that ends it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from shardtune.checkpoint.durable import fsync_path, fsync_tree

# For tests: seconds the background writer waits before it writes, so that a kill or a stop signal can be made
# to land while a save is in flight.
WRITE_DELAY_ENV = "SHARDTUNE_CHECKPOINT_WRITE_DELAY_S"


class PendingSave:
    """The writes of one save and their fsync. `run` does them, in the caller's thread (synchronous saves) or in
    a background thread (`start`)."""

    def __init__(self, step: int, scratch: str, final: str) -> None:
        self.step, self.scratch, self.final = step, scratch, final
        self.writes: list[tuple[str, Callable[[str], None]]] = []
        self.futures: list[Future] = []
        self.started = time.perf_counter()
        self.staged_s = 0.0
        self.finished: float | None = None  # when this rank's files were all durable
        self.error: BaseException | None = None
        self.done = threading.Event()

    def add(self, path: str, write: Callable[[str], None]) -> None:
        """`write(path)` writes one file of the checkpoint, from a copy of the state taken at this step."""
        self.writes.append((path, write))

    def start(self) -> None:
        threading.Thread(target=self.run, kwargs={"delay": float(os.environ.get(WRITE_DELAY_ENV) or 0)},
                         name=f"checkpoint-{self.step}-writer", daemon=True).start()

    def run(self, delay: float = 0.0) -> None:
        try:
            time.sleep(delay)
            while self.writes:
                path, write = self.writes.pop(0)
                write(path)
                fsync_path(path)
            for future in self.futures:
                future.result()
            fsync_tree(self.scratch)
        except BaseException as error:  # reported by every rank at the next step boundary
            self.error = error
        finally:
            self.finished = time.perf_counter()
            self.done.set()

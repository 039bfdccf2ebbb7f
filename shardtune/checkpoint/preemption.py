"""Stop requests from the scheduler: SIGTERM (scancel, preemption), SIGINT (Ctrl-C) and SIGUSR1 (SLURM's
`--signal=USR1@<seconds>` warning). The trainer saves a checkpoint at the next step boundary and exits with
PREEMPTED_EXIT_CODE, which a requeue script treats as "resume me" rather than as a failure."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: a temporary failure, try again
NON_FINITE_EXIT_CODE = 3  # the loss or gradient norm became inf/NaN: retrying the same state will not help
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """Remembers the first stop signal; the trainer checks it once per optimizer step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


# For tests of what a failure costs: a rank that signals itself at a chosen place of the run, so that a kill,
# a freeze or a stop request lands where the test says (inside an accumulation cycle, say), not wherever a
# poll from outside happens to catch the run.
FAULT_ENV = "SHARDTUNE_FAULT"  # e.g. "rank=1,step=5,micro_batch=1,signal=SIGKILL"


@dataclass(frozen=True)
class Fault:
    """After the backward of micro-batch `micro_batch` (0-based) of optimizer step `step`, rank `rank` sends
    itself `signal` (SIGKILL: dies; SIGSTOP: freezes; SIGTERM: asks for a checkpoint and exit 75)."""

    rank: int
    step: int
    micro_batch: int
    signal: signal.Signals

    @classmethod
    def from_env(cls, rank: int) -> Fault | None:
        """This rank's fault from FAULT_ENV, if any (a fault for another rank is None here)."""
        text = os.environ.get(FAULT_ENV, "").strip()
        if not text:
            return None
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            fault = cls(int(fields["rank"]), int(fields["step"]), int(fields.get("micro_batch", 0)),
                        signal.Signals[fields["signal"].upper()])
        except (KeyError, ValueError) as error:
            raise ValueError(f"{FAULT_ENV}={text!r}: expected rank=R,step=S,micro_batch=M,signal=NAME") from error
        return fault if fault.rank == rank else None

    def after_backward(self, step: int, micro_batch: int) -> None:
        if (step, micro_batch) == (self.step, self.micro_batch):
            print(f"shardtune: fault injection: rank {self.rank} sends itself {self.signal.name} at step {step}, "
                  f"micro-batch {micro_batch}", flush=True)
            os.kill(os.getpid(), self.signal)

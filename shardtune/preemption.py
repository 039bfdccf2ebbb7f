"""Stop requests from the scheduler: SIGTERM (scancel, preemption), SIGINT (Ctrl-C) and SIGUSR1 (SLURM's
`--signal=USR1@<seconds>` warning). The trainer saves a checkpoint at the next step boundary and exits with
PREEMPTED_EXIT_CODE, which a requeue script treats as "resume me" rather than as a failure."""

from __future__ import annotations

import signal

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

"""The host RAM and time of converting a DeepSpeed ZeRO checkpoint to the universal form, planned before it starts.

shardtune runs DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`) as one process, with one extract and
one merge worker: the training ranks already hold their own states in host RAM (under CPU offload, 12 bytes per
parameter over the node's ranks), so the conversion adds one rank's file at a time, not four (DeepSpeed's default
workers). Its peak is then, read from the converter's code:

- the interpreter with torch and DeepSpeed imported (measured at plan time: a process importing the converter);
- extraction: one rank's `*optim_states.pt`, loaded whole (torch.load), plus one fragment cloned out of it;
- merging: one parameter's state, its rank fragments and their concatenation (2 x 4 bytes x its elements);
- ZeRO-1/2: the model states file (whole weights), which the converter loads to fill the parameters no optimizer
  fragment covers.

The time: the interpreter's start plus reading and writing the optimizer states twice over (extract: read, write
fragments; merge: read them, write each parameter's states), at DISK_BYTES_PER_S, and a cost per file written."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass

DISK_BYTES_PER_S = 1e9  # a local NVMe or a parallel filesystem's client, read and write: the estimate's assumption
SECONDS_PER_FILE = 2e-3  # torch.save of one small fragment, measured on CPU (about 1 ms to 3 ms)
FP32 = 4
STATES = ("fp32", "exp_avg", "exp_avg_sq")  # what the converter writes per parameter (and `step`)
OPTIM_FILE = re.compile(r".*optim_states\.pt$")
MODEL_FILE = re.compile(r".*model_states\.pt$")
# Prints the interpreter's peak RSS in kB and its import time: what the converter's process costs before any data.
PROBE = ("import resource, time; t = time.perf_counter(); import deepspeed.checkpoint.ds_to_universal; "
         "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - t)")


@dataclass(frozen=True)
class ConversionPlan:
    """The converter's planned peak host RAM (`peak_bytes` = its interpreter + the largest data it holds at once)
    and its time."""

    interpreter_bytes: int
    data_bytes: int
    seconds: float
    source_bytes: int
    ranks: int

    @property
    def peak_bytes(self) -> int:
        return self.interpreter_bytes + self.data_bytes

    def line(self, source: str) -> str:
        return (f"shardtune: planned conversion of {source} ({self.ranks} ranks' ZeRO files, "
                f"{size(self.source_bytes)}): "
                f"peak host RAM {size(self.peak_bytes)} in one process (interpreter {size(self.interpreter_bytes)} "
                f"+ {size(self.data_bytes)} of states held at once), about {self.seconds:.0f}s")


    def shortfall(self, available: int) -> str | None:
        """A warning line where the planned peak exceeds the host RAM `available` now (the training ranks' states
        are already there), else None."""
        if self.peak_bytes <= available:
            return None
        return (f"shardtune: warning: the conversion's planned peak host RAM, {size(self.peak_bytes)}, exceeds the "
                f"{size(available)} available now: the kernel may kill it for memory. Free host RAM on this node "
                "(fewer ranks, no CPU offload), or resume on the number of processes that saved the checkpoint.")


def size(count: float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def interpreter_cost() -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of a process that imports the converter: measured, not assumed (it depends on
    the torch build and the machine)."""
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    kilobytes, seconds = result.stdout.split()[-2:]
    return int(kilobytes) * 1024, float(seconds)


def parameter_sizes(model_file: str) -> list[int]:
    """Every parameter's elements, from the shapes DeepSpeed records in a model states file (mapped: a ZeRO-1/2
    file holds the whole weights)."""
    import torch
    from deepspeed.checkpoint.constants import PARAM_SHAPES

    shapes = torch.load(model_file, map_location="cpu", weights_only=False, mmap=True)[PARAM_SHAPES]
    return [shape.numel() for group in (shapes if isinstance(shapes, list) else [shapes]) for shape in group.values()]


def plan_conversion(deepspeed_dir: str, zero_stage: int, interpreter: tuple[int, float] | None = None
                    ) -> ConversionPlan:
    """The plan of converting `deepspeed_dir` (a checkpoint's `pytorch_model/`, saved under ZeRO-`zero_stage`)."""
    files = sorted(glob.glob(os.path.join(deepspeed_dir, "*.pt")))
    optim = [os.path.getsize(path) for path in files if OPTIM_FILE.match(path)]
    model = [path for path in files if MODEL_FILE.match(path)]
    if not optim or not model:
        raise FileNotFoundError(f"{deepspeed_dir} holds no DeepSpeed ZeRO files (*optim_states.pt, *model_states.pt)")
    sizes = parameter_sizes(model[0])
    largest = max(sizes, default=0)
    ranks = len(optim)
    extract = max(optim) + FP32 * (largest // ranks + 1)
    merge = 2 * FP32 * largest
    held = max(extract, merge, *(os.path.getsize(path) for path in model)) if zero_stage < 3 else max(extract, merge)
    rss, start = interpreter or interpreter_cost()
    source = sum(optim) + sum(os.path.getsize(path) for path in model)
    written = len(sizes) * (len(STATES) + 1) * (ranks + 1)  # each parameter's states per rank, then merged
    seconds = start + 4 * sum(optim) / DISK_BYTES_PER_S + written * SECONDS_PER_FILE
    return ConversionPlan(rss, held, seconds, source, ranks)


def run_measured(command: list[str]) -> tuple[int, str, int]:
    """(exit status, stderr, the process's peak RSS in bytes, from the kernel: wait4's rusage of that child)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    process.stderr.close()
    return process.returncode, stderr, usage.ru_maxrss * 1024

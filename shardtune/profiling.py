"""Peak of live tensor bytes per rank, per phase of a run, from the PyTorch profiler's allocator events.

Set SHARDTUNE_PROFILE_MEMORY=<folder> and every rank writes <folder>/memory_rank<r>.json: for each phase of the
run (the step's forward/backward, the optimizer step, eval, the final save) and each time it ran, the bytes live
at its start and the most live within it. The planner's phases (shardtune.plan.phases.phase_bytes) are tested against
these figures (tests/launch/test_memory_phases.py).

How it counts: `profile_memory=True` makes the c10 allocators report every allocation and free with the running
total of bytes allocated (`total_allocated`; it works on CPU too). Each phase is a `record_function` range on the
same clock; its peak is the bytes live at its start plus the highest rise of that total within it.
- The bytes live at a phase's start are counted on the live objects: every tensor Python can reach (the model's
  parameters and gradients, the optimizer's states, DeepSpeed's flat buffers), each storage once. Phases start
  where no autograd graph is alive. Not from the allocator: weights memory-mapped from the checkpoint never
  passed through it.
- The allocator keeps every block's size from before the model is built, so that a phase's frees of blocks
  allocated while building are counted too (DDP, for one, replaces its gradient buckets in the second step); the
  profiler records the first PROFILED_STEPS steps and the final save and eval (it records every operator).
- The profiler records events on the threads it follows only, and the CPU allocator subtracts a free made on
  another thread (gloo's workers release the buffers of the collectives they ran) only under c10's flag
  caffe2_report_cpu_memory_usage, set while profiling: without it the total misses those frees and only grows.
On a CPU machine host and device are one memory: CPU-offloaded states and a state dict gathered to the host count
here as well. Profiling records every operator: meant for short measurement runs, not training.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import gc
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ENV = "SHARDTUNE_PROFILE_MEMORY"
PHASES = ("forward_backward", "optimizer", "eval", "save")
_PREFIX = "shardtune.phase:"


# Steps profiled whole: the first (where the optimizer creates its states) and the second (where DDP rebuilds its
# buckets, as every later step runs). The profiler pauses after them (it records every operator, which slows a run
# by a third) and resumes for the final save and eval.
PROFILED_STEPS = 2


class PhaseRecorder:
    """Profiler sessions over a run, with named phases marked on their clock: one over the first PROFILED_STEPS
    steps, one over the final save and eval."""

    def __init__(self) -> None:
        self._profile: profile | None = None
        self._open: record_function | None = None
        self._open_name = ""
        self.started, self.baseline, self.paused = False, 0, False
        self.model: torch.nn.Module | None = None
        self.starts: list[int] = []  # bytes live at the start of each phase of the current session, in order
        self.steps = 0
        self._figures: list[dict[str, Any]] = []  # of the sessions ended
        self.largest_batch: dict[str, list[int]] = {}  # per phase, the shape of the largest input_ids recorded

    def start(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        self.starts, self.paused = [], False

    def _end_session(self) -> None:
        self.end()
        self._profile.__exit__(None, None, None)
        self._figures.append(phase_figures(self._profile.profiler.kineto_results.experimental_event_tree(),
                                           self.starts))
        self._profile = None

    def watch(self, model: torch.nn.Module) -> None:
        """Phases may begin from now on; the bytes live now are the baseline. Each recorded phase also notes the
        largest batch the model ran (rows, length of its input_ids: a packed row is one row)."""
        self.model, self.baseline = model, live_tensor_bytes(model)
        self.started = True
        model.register_forward_pre_hook(self._note_batch, with_kwargs=True)

    def _note_batch(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self._open is None or not isinstance(ids, torch.Tensor):
            return
        largest = self.largest_batch.get(self._open_name, [0, 0])
        if ids.numel() > largest[0] * largest[1]:
            self.largest_batch[self._open_name] = list(ids.shape)

    def begin(self, name: str) -> None:
        """Start phase `name`, ending the one open (phases never nest); nothing if `name` is open already. The
        step after the profiled ones pauses the profiler; a save or eval after that resumes it."""
        if self._open is not None and self._open_name == name:
            return
        if name == "forward_backward":
            self.steps += 1
            if self.steps == PROFILED_STEPS + 1:
                self._end_session()
                self.paused = True
        if self.paused:
            if name not in ("save", "eval"):
                return
            self.start()
        self.end()
        self.starts.append(live_tensor_bytes(self.model))
        self._open, self._open_name = record_function(_PREFIX + name), name
        self._open.__enter__()

    def end(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None

    def stop(self) -> dict[str, Any]:
        """Stop profiling and return the per-phase figures of every session (see `phase_figures`)."""
        if self._profile is not None:
            self._end_session()
        phases: dict[str, list[dict[str, int]]] = {}
        for figures in self._figures:
            for name, runs in figures["phases"].items():
                phases.setdefault(name, []).extend(runs)
        peak = {name: max(run["peak"] for run in runs) for name, runs in phases.items()}
        return {"baseline": self.baseline, "phases": phases, "peak": peak, "largest_batch": self.largest_batch}


def live_tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every storage reachable from Python now, each once (local shards of DTensors, ZeRO-3 partitions
    and flat buffers are tensors of their own), the model's parameters and gradients included."""
    from shardtune.memory import local

    seen, total = set(), 0
    candidates = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]  # no __class__ lookups
    candidates += [tensor for param in model.parameters() for tensor in (param, param.grad) if tensor is not None]
    for tensor in candidates:
        with contextlib.suppress(RuntimeError):  # a wrapper subclass without storage of its own
            storage = local(tensor).untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if tensor.device.type != "meta" and storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _walk(events: list) -> Iterator:
    for event in events:
        yield event
        yield from _walk(event.children)


def phase_figures(roots: list, starts: list[int]) -> dict[str, Any]:
    """{"phases": {name: [{"start": bytes, "peak": bytes}, ...]}} of one session: the i-th phase (in time) starts
    with starts[i] bytes live and peaks at that plus the most the allocators' totals rose within it. Each
    allocation event carries its allocator's running total after it, so the total before a phase's first event is
    that total less the event's size (frees are negative): no event before the phase is needed. Devices are added
    together: on CPU there is one."""
    from torch._C._profiler import _EventType

    allocations, ranges = [], []
    for event in _walk(roots):
        kind, fields = event.typed
        if kind == _EventType.Allocation:
            allocations.append((event.start_time_ns, fields.total_allocated, fields.alloc_size, str(fields.device)))
        elif event.name.startswith(_PREFIX):
            ranges.append((event.start_time_ns, event.end_time_ns, event.name[len(_PREFIX):]))
    allocations.sort()
    times = [time_ns for time_ns, *_ in allocations]
    phases: dict[str, list[dict[str, int]]] = {}
    for (start_ns, end_ns, name), at_start in zip(sorted(ranges), starts, strict=True):
        first, last = bisect.bisect_left(times, start_ns), bisect.bisect_right(times, end_ns)
        rise = _largest_rise(allocations[first:last])
        phases.setdefault(name, []).append({"start": at_start, "peak": at_start + rise})
    return {"phases": phases}


def _largest_rise(allocations: list[tuple[int, int, int, str]]) -> int:
    """The most the summed allocators' totals stood above their values before the first of these events."""
    before: dict[str, int] = {}
    latest: dict[str, int] = {}
    rise = 0
    for _, total, size, device in allocations:
        before.setdefault(device, total - size)
        latest[device] = total - before[device]
        rise = max(rise, sum(latest.values()))
    return rise


_recorder: PhaseRecorder | None = None


@contextlib.contextmanager
def profile_memory(rank: int) -> Iterator[None]:
    """When SHARDTUNE_PROFILE_MEMORY names a folder: profile the block (its phases begin once `start_phases` ran)
    and write this rank's figures there at its end (also when it raises: a failed run's phases are what one wants
    to see). A no-op otherwise."""
    global _recorder
    folder = os.environ.get(ENV)
    if not folder:
        yield
        return
    _recorder = PhaseRecorder()
    # From before the model is built, the CPU allocator keeps the size of every block: a phase's free of a block
    # allocated while building (DDP replaces its gradient buckets in the second step) is counted. The profiler
    # itself starts with the first step (start_phases).
    count_every_thread = _cpu_allocator_flag(True)
    try:
        yield
    finally:
        recorder, _recorder = _recorder, None
        if recorder.started:  # a run that failed before its first step has nothing to report
            figures = recorder.stop()
            figures["every_thread"] = count_every_thread
            _write(figures, folder, rank)
        _cpu_allocator_flag(False)


def _cpu_allocator_flag(on: bool) -> bool:
    """Set c10's FLAGS_caffe2_report_cpu_memory_usage (libc10's exported bool): the CPU allocator then keeps its
    running total over every thread. False where this build of torch does not export it."""
    try:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = on
    except (OSError, ValueError):
        return False
    return True


def _write(figures: dict[str, Any], folder: str, rank: int) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"memory_rank{rank}.json"), "w") as file:
        json.dump({"rank": rank, **figures}, file)


def begin_phase(name: str) -> None:
    """Mark the start of phase `name` (and the end of the one before) when profiling; else nothing."""
    if _recorder is not None and _recorder.started:
        _recorder.begin(name)


def end_phase() -> None:
    if _recorder is not None:
        _recorder.end()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    begin_phase(name)
    try:
        yield
    finally:
        end_phase()


def start_phases(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Let phases begin (inside `profile_memory`; else nothing), right before the first step. The "optimizer"
    phase begins when the innermost torch optimizer starts stepping: under DeepSpeed the step runs inside the last
    micro-batch's backward (accelerate calls engine.step there), once per parameter group or ZeRO-3 sub-group;
    the reductions and the gradient norm before it stay in forward_backward."""
    if _recorder is None:
        return
    from shardtune.memory import innermost_optimizer

    innermost_optimizer(optimizer).register_step_pre_hook(lambda *_: begin_phase("optimizer"))
    _recorder.start()
    _recorder.watch(model)

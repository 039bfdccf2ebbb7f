"""torch's caching host allocator set for DeepSpeed's offloaded buffers before anything is pinned: in a module of
its own, light to import (torch alone), so that a process sets it before accelerate and DeepSpeed load."""

from __future__ import annotations

import os
import sys

import torch

from shardtune.plan.host import PINNED_MAX_CACHED_MB


def exact_pinned_host_memory() -> None:
    """DeepSpeed pins its host buffers with `tensor.pin_memory()` (abstract_accelerator.py), through torch's
    caching host allocator, which by default takes the next power of two for every block and keeps freed blocks
    (ATen/core/CachingHostAllocator.h `allocate`, `maybe_cache_block`): a 35.3 GB gradient partition would take
    68.7 GB. A block above pinned_max_cached_size_mb is allocated at its size and freed back to the system; the
    planner counts that (shardtune.plan.host.pinned_rounding_bytes). Set before anything is pinned; read on
    every allocation. DeepSpeed runs that offload only (nothing else pins large buffers): FSDP's CPU offload pins a
    new gradient copy per parameter every step, and TRL's activation offloading one copy per saved activation
    (refused with DeepSpeed's offload: checks.check_activation_offloading), which the cache serves. An environment
    that names the option keeps its own value; its other options are kept, since torch resets every option the new
    settings leave out."""
    configured = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if "pinned_max_cached_size_mb" not in configured:
        limit = f"pinned_max_cached_size_mb:{PINNED_MAX_CACHED_MB}"
        try:
            torch._C._accelerator_setAllocatorSettings(f"{configured},{limit}" if configured else limit)
        except ValueError:  # a torch without the option (2.11, the GPU machine's, has none)
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"shardtune: warning: torch {torch.__version__} has no pinned_max_cached_size_mb: DeepSpeed's "
                      "pinned host buffers are rounded up to powers of two and kept, up to twice the host RAM "
                      "planned for the offloaded states (torch 2.13 has the option).", file=sys.stderr, flush=True)

"""Compile DeepSpeed's CPU ops once per machine (they land in ~/.cache/torch_extensions) and say which ones:
CPU Adam (offload), async I/O (NVMe offload) and the shared-memory collectives every DeepSpeed run on CPU loads."""

from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

for builder in (CPUAdamBuilder(), AsyncIOBuilder(), get_accelerator().create_op_builder("ShareMemCommBuilder")):
    if builder.is_compatible(verbose=False):
        builder.load(verbose=False)
        print(f"deepspeed op {builder.name}: ready")
    else:
        print(f"deepspeed op {builder.name}: not compatible on this machine, tests that need it skip")

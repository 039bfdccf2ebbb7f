"""Compile DeepSpeed's CPU ops once per machine (they land in ~/.cache/torch_extensions) and say which ones."""

from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
    if builder.is_compatible(verbose=False):
        builder.load(verbose=False)
        print(f"deepspeed op {builder.name}: ready")
    else:
        print(f"deepspeed op {builder.name}: not compatible on this machine, tests that need it skip")

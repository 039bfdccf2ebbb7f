"""Compile DeepSpeed's CPU ops once per machine (they land in ~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR)
and say which ones: CPU Adam (offload), async I/O (NVMe offload) and the shared-memory collectives every DeepSpeed
run on CPU loads.

    python scripts/build_deepspeed_ops.py
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)  # no options: --help answers before anything compiles
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    for builder in (CPUAdamBuilder(), AsyncIOBuilder(), get_accelerator().create_op_builder("ShareMemCommBuilder")):
        if builder.is_compatible(verbose=False):
            builder.load(verbose=False)
            print(f"deepspeed op {builder.name}: ready")
        else:
            print(f"deepspeed op {builder.name}: not compatible on this machine, tests that need it skip")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Write into .whl/ the wheels `scripts/gpu_check.py` needs on a GPU machine that has only torch, transformers,
accelerate, peft and safetensors (and what they require) and no package index: `make gpu-wheels`.

What is missing there is computed from this virtualenv's metadata: every distribution that datasets, DeepSpeed,
torchao and Liger's kernels require, transitively, that the device's packages do not, at the version installed here
(the versions this repository is tested with). Each is downloaded as a binary wheel for the device's Python and
x86-64 Linux; DeepSpeed, which PyPI has as a source distribution only, is built here as a wheel with no ops prebuilt
(the checks' cases JIT-compile none). Each wheel is then recompressed with LZMA (a valid wheel: pip reads it as any
zip; its RECORD hashes the uncompressed files): pyarrow alone is 55 MB with zip's deflate. The set must stay under
WHEELS_LIMIT_MIB, the carried working tree's 64 MiB less the repository itself; the script exits 1 (one line) if not.

    python scripts/gpu_wheels.py [--dest .whl] [--python_version 3.12]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# What the GPU machine has installed (its CUDA torch brings triton, which this CPU build of torch does not require).
DEVICE_HAS = ("torch", "transformers", "accelerate", "peft", "safetensors", "triton")
# What gpu_check's cases import beyond those: the data pipeline, ZeRO-3, the levers and fp8, Liger's kernels.
CHECK_NEEDS = ("datasets", "deepspeed", "torchao", "liger-kernel")
WHEELS_LIMIT_MIB = 60  # of the 64 MiB carried with the working tree, which itself takes about 2
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64")
BUILT_HERE = ("deepspeed",)  # no wheel on PyPI


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names: tuple[str, ...]) -> dict[str, str]:
    """Each distribution `names` require, transitively (extras left out), with the version installed here; a
    distribution not installed here is left out."""
    found: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = normalized(todo.pop())
        if name in found:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = distribution.version
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def missing_on_device() -> dict[str, str]:
    """The distributions the check needs that the device lacks, with their versions here."""
    present = closure(DEVICE_HAS)
    return {name: version for name, version in closure(CHECK_NEEDS).items() if name not in present}


def download(pins: dict[str, str], dest: Path, python_version: str) -> None:
    platforms = [word for platform in PLATFORMS for word in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, *platforms, "-d", str(dest),
                    *(f"{name}=={version}" for name, version in pins.items())], check=True)


def build(pins: dict[str, str], dest: Path) -> None:
    """Pure-Python wheels built here from their source distributions (DeepSpeed: DS_BUILD_OPS=0, no op compiled)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
                    *(f"{name}=={version}" for name, version in pins.items())], check=True,
                   env={**os.environ, "DS_BUILD_OPS": "0"})


def recompress(wheel: Path) -> None:
    """The same wheel, its members LZMA-compressed, in place."""
    with tempfile.NamedTemporaryFile(dir=wheel.parent, suffix=".tmp", delete=False) as scratch:
        with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(scratch, "w", zipfile.ZIP_LZMA) as target:
            for member in source.infolist():
                target.writestr(member, source.read(member.filename), compress_type=zipfile.ZIP_LZMA)
    os.replace(scratch.name, wheel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(REPO / ".whl"), help="the folder written (default: %(default)s)")
    parser.add_argument("--python_version", default="3.12", help="the device's Python (default: %(default)s)")
    args = parser.parse_args(argv)
    pins = missing_on_device()
    dest = Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    download({name: version for name, version in pins.items() if name not in BUILT_HERE}, dest, args.python_version)
    build({name: version for name, version in pins.items() if name in BUILT_HERE}, dest)
    wheels = sorted(dest.glob("*.whl"))
    for wheel in wheels:
        recompress(wheel)
    total = sum(wheel.stat().st_size for wheel in wheels)
    (dest / "manifest.json").write_text(json.dumps({"python_version": args.python_version, "pins": pins,
                                                    "wheels": {wheel.name: wheel.stat().st_size for wheel in wheels}},
                                                   indent=2))
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.1f} MiB  {wheel.name}")
    print(f"{total / 2**20:8.1f} MiB  in {len(wheels)} wheels, for Python {args.python_version} (limit "
          f"{WHEELS_LIMIT_MIB} MiB)")
    if total > WHEELS_LIMIT_MIB * 2**20:
        print(f"gpu_wheels: error: {total / 2**20:.1f} MiB is over the {WHEELS_LIMIT_MIB} MiB the device command can "
              "carry beside the working tree.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

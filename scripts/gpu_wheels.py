"""Write into .whl/ the wheels `scripts/gpu_check.py` needs on the device tool's GPU machine, which has a package list
of its own (scripts/device_packages.txt) and no package index: `make gpu-wheels`.

The set is computed against that list: datasets, DeepSpeed, torchao and Liger's kernels (CHECK_NEEDS), transformers
and peft at requirements.txt's versions where the device's differs or was not read (PINNED), then each of their
requirements (markers evaluated for the device's Python 3.12 on x86-64 Linux) that neither the device nor the set
meets, transitively, at the version installed in this virtualenv (the versions this repository is tested with).
Nothing the device has is carried unless another version is needed. Each is downloaded as a binary wheel for the
device's Python; DeepSpeed, which PyPI has as a source distribution only, is built here as a wheel with no ops
prebuilt (the check's cases JIT-compile none). Each wheel is recompressed with LZMA (pip reads it as any zip). The
set must stay under WHEELS_LIMIT_MIB, the carried 64 MiB less the working tree; the script exits 1 (one line) if
not, or if a wheel's Requires-Dist is met by neither the device nor the set. For the device's Python it also writes
SET_RECORD (checked in: tests/unit/gpu_check/test_gpu_wheels.py holds the set to the device list without building it).

    python scripts/gpu_wheels.py [--dest .whl] [--python_version 3.12]
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from shardtune.checks.command_line import OneLineParser

REPO = Path(__file__).resolve().parents[1]
DEVICE_LIST = REPO / "scripts" / "device_packages.txt"
SET_RECORD = REPO / "scripts" / "device_wheels.json"
DEVICE_PYTHON = "3.12"
# What gpu_check's cases import that the device lacks: the data pipeline, ZeRO-3, the levers and fp8, Liger's kernels.
CHECK_NEEDS = ("datasets", "deepspeed", "torchao", "liger-kernel")
# Carried at requirements.txt's version unless the device has exactly it (accelerate 1.15.0 does): then only torch
# differs from what the suite tests.
PINNED = ("transformers", "accelerate", "peft")
WHEELS_LIMIT_MIB = 60  # of the 64 MiB carried with the working tree, which itself takes about 2
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64")
BUILT_HERE = ("deepspeed",)  # no wheel on PyPI
# The device's environment markers (PEP 508), for requirements such as `; python_version < "3.13"`.
DEVICE_MARKERS = {"python_version": DEVICE_PYTHON, "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_device_packages(path: Path = DEVICE_LIST) -> dict[str, str | None]:
    """The device's distributions: normalized name -> version, None where the list gives none."""
    packages: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[normalized(name)] = version or None
    return packages


def read_pins(path: Path = REPO / "requirements.txt") -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[normalized(name)] = version.strip()
    return pins


def applies(requirement: Requirement) -> bool:
    """Whether a requirement holds on the device (extras left out)."""
    return requirement.marker is None or requirement.marker.evaluate(DEVICE_MARKERS)


def satisfies(version: str, requirement: Requirement) -> bool:
    return requirement.specifier.contains(Version(version).public, prereleases=True)


def provider(name: str, device: dict[str, str | None], carried: dict[str, str]) -> tuple[str, str | None] | None:
    """Who provides `name` there and at which version: the set first (it comes first on PYTHONPATH), else the
    device; None where neither does."""
    if name in carried:
        return "set", carried[name]
    if name in device:
        return "device", device[name]
    return None


def unmet(requires: dict[str, list[str]], device: dict[str, str | None], carried: dict[str, str]) -> list[str]:
    """Each requirement of each carried distribution (`requires`: name -> its Requires-Dist lines) that applies on
    the device and is met by neither the set (`carried`: name -> version) nor the device's list; a device package
    whose version was not read meets any version."""
    problems = []
    for name, lines in sorted(requires.items()):
        for line in lines:
            requirement = Requirement(line)
            if not applies(requirement):
                continue
            found = provider(normalized(requirement.name), device, carried)
            if found is None:
                problems.append(f"{name} {carried[name]} requires {line}: neither the device nor the set has it")
            elif found[1] is not None and not satisfies(found[1], requirement):
                problems.append(f"{name} {carried[name]} requires {line}: the {found[0]} has {found[1]}")
    return problems


def unverified(requires: dict[str, list[str]], device: dict[str, str | None], carried: dict[str, str]) -> list[str]:
    """The requirements with a version range taken as met by a device package whose version was not read."""
    found = set()
    for lines in requires.values():
        for line in lines:
            requirement = Requirement(line)
            name = normalized(requirement.name)
            if applies(requirement) and requirement.specifier and name not in carried and name in device \
                    and device[name] is None:
                found.add(f"{name}{requirement.specifier}")
    return sorted(found)


def installed_problems(record: dict | None = None) -> list[str]:
    """Each requirement of the carried set (SET_RECORD's wheels, or `record`'s) that the running environment, as
    installed, does not meet: on the device, the ranges this list could only take as met (its unread versions)."""
    wheels = (record or json.loads(SET_RECORD.read_text()))["wheels"]
    problems = []
    for name, entry in sorted(wheels.items()):
        for line in entry["requires"]:
            requirement = Requirement(line)
            if not applies(requirement):
                continue
            try:
                version = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{name} {entry['version']} requires {line}: not installed")
                continue
            if not satisfies(version, requirement):
                problems.append(f"{name} {entry['version']} requires {line}: {version} is installed")
    return problems


def installed(name: str) -> importlib.metadata.Distribution:
    return importlib.metadata.distribution(name)


def wheel_set(device: dict[str, str | None], pins: dict[str, str]) -> dict[str, str]:
    """name -> version of every distribution to carry: CHECK_NEEDS, PINNED where the device's version is not the pin,
    then whatever their requirements need that the device does not meet, transitively. Versions: the pin, else this
    virtualenv's. Raises ValueError naming a requirement this virtualenv's version does not meet or that is not
    installed here."""
    carried: dict[str, str] = {}
    todo = [*CHECK_NEEDS, *(name for name in PINNED if device.get(name) != pins[name])]
    while todo:
        name = normalized(todo.pop(0))
        if name in carried:
            continue
        try:
            carried[name] = pins.get(name) or installed(name).version
            requires = installed(name).requires or []
        except importlib.metadata.PackageNotFoundError as error:
            raise ValueError(f"{name} is needed on the device but not installed here: `make .venv/installed`") \
                from error
        for line in requires:
            requirement = Requirement(line)
            needed = normalized(requirement.name)
            if not applies(requirement) or needed in carried:
                continue
            on_device = provider(needed, device, {})
            if on_device is None or (on_device[1] is not None and not satisfies(on_device[1], requirement)):
                todo.append(needed)
    return carried


def wheel_requires(path: Path) -> tuple[str, str, list[str]]:
    """A wheel's name, version and Requires-Dist lines, from its METADATA."""
    with zipfile.ZipFile(path) as wheel:
        member = next(item for item in wheel.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", item))
        metadata = email.parser.Parser().parsestr(wheel.read(member).decode())
    return normalized(metadata["Name"]), metadata["Version"], metadata.get_all("Requires-Dist") or []


def download(pins: dict[str, str], dest: Path, python_version: str) -> None:
    platforms = [word for platform in PLATFORMS for word in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(dest),
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


def record(wheels: list[Path], python_version: str, device: dict[str, str | None]) -> dict:
    """What the set is, from the wheels themselves: each one's file, size, version and Requires-Dist; the problems
    unmet finds; the requirements taken as met on an unread version."""
    entries, requires, carried = {}, {}, {}
    for wheel in wheels:
        name, version, lines = wheel_requires(wheel)
        entries[name] = {"version": version, "file": wheel.name, "bytes": wheel.stat().st_size, "requires": lines}
        requires[name], carried[name] = lines, version
    return {"python_version": python_version, "device_list": DEVICE_LIST.name, "wheels": entries,
            "unmet": unmet(requires, device, carried), "unverified": unverified(requires, device, carried)}


def earlier_set(dest: Path) -> tuple[list[Path], list[str]]:
    """The files of the set an earlier run wrote into `dest` (its wheels, as its manifest.json lists them, and the
    manifest), and the names of whatever else `dest` holds, hidden ones included: those are not this script's to
    delete, and a wheel among them would join the set."""
    if not dest.is_dir():
        return [], []
    manifest = dest / "manifest.json"
    try:
        listed = {entry["file"] for entry in json.loads(manifest.read_text())["wheels"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        listed = set()
    ours = [dest / name for name in sorted(listed)] + ([manifest] if listed else [])
    strangers = sorted(path.name for path in dest.iterdir() if path not in ours)
    return ours, strangers


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(REPO / ".whl"), help="the folder written (default: %(default)s)")
    parser.add_argument("--python_version", default=DEVICE_PYTHON, help="the Python the wheels are for (default: "
                        "%(default)s, the device's; another builds the same set for a rehearsal here)")
    args = parser.parse_or_exit(argv)
    device = read_device_packages()
    try:
        pins = wheel_set(device, read_pins())
    except ValueError as error:
        print(f"gpu_wheels: error: {error}", file=sys.stderr)
        return 1
    dest = Path(args.dest)
    earlier, strangers = earlier_set(dest)
    if strangers:
        print(f"gpu_wheels: error: --dest {str(dest)!r} holds {', '.join(strangers[:3])}"
              f"{' and more' * (len(strangers) > 3)}, which no earlier set written here lists: the set is what the "
              "folder holds, so give --dest a folder of its own (default .whl/).", file=sys.stderr)
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    for old in earlier:  # only what an earlier run of this script wrote, as its manifest lists
        old.unlink(missing_ok=True)
    download({name: version for name, version in pins.items() if name not in BUILT_HERE}, dest, args.python_version)
    build({name: version for name, version in pins.items() if name in BUILT_HERE}, dest)
    wheels = sorted(dest.glob("*.whl"))
    for wheel in wheels:
        recompress(wheel)
    manifest = record(wheels, args.python_version, device)
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if args.python_version == DEVICE_PYTHON:
        SET_RECORD.write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(wheel.stat().st_size for wheel in wheels)
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.1f} MiB  {wheel.name}")
    print(f"{total / 2**20:8.1f} MiB  in {len(wheels)} wheels, for Python {args.python_version} (limit "
          f"{WHEELS_LIMIT_MIB} MiB); taken as met on versions not read: {', '.join(manifest['unverified']) or 'none'}")
    problems = manifest["unmet"] + ([f"{total / 2**20:.1f} MiB is over the {WHEELS_LIMIT_MIB} MiB the device "
                                     "command can carry beside the working tree"]
                                    if total > WHEELS_LIMIT_MIB * 2**20 else [])
    for problem in problems:
        print(f"gpu_wheels: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

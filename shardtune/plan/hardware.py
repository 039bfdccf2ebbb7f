"""GPUs: dense BF16 peak FLOP/s, device-name lookup, and the `--hardware` names the planner accepts."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace

# Dense (no 2:4 sparsity) BF16 tensor-core peaks from the vendor data sheets. H100 means the SXM part; the PCIe card
# has fewer SMs and lower clocks. H200 is the same GH100 die as the H100 SXM, with more and faster memory.
PEAK_BF16_FLOPS: dict[str, float] = {
    "a100": 312e12,
    "h100": 989e12,
    "h100-pcie": 756e12,
    "h200": 989e12,
    "b200": 2.25e15,
}

# Checked in this order: "h100-pcie" before "h100", so that "NVIDIA H100 PCIe" does not match the SXM peak.
_DEVICE_PATTERNS: list[tuple[str, str]] = [
    ("h100-pcie", r"\bh100\b.*\bpcie\b"),
    ("h100", r"\bh100\b"),
    ("h200", r"\bh200\b"),
    ("a100", r"\ba100\b"),
    ("b200", r"\bb200\b"),
]


def gpu_key(device_name: str) -> str | None:
    """Map `torch.cuda.get_device_name()` (e.g. "NVIDIA H100 80GB HBM3") to a PEAK_BF16_FLOPS key.

    Unknown devices give None and a warning: a guessed peak would make every MFU figure wrong."""
    name = device_name.lower().replace("_", " ")
    for key, pattern in _DEVICE_PATTERNS:
        if re.search(pattern, name):
            return key
    warnings.warn(f"Unknown GPU {device_name!r}: no BF16 peak known, so no MFU is reported.", stacklevel=2)
    return None


def peak_flops(gpu: str | None) -> float | None:
    """Peak for a key or a device name; None when unknown."""
    if gpu is None:
        return None
    key = gpu.lower()
    if key in PEAK_BF16_FLOPS:
        return PEAK_BF16_FLOPS[key]
    key = gpu_key(gpu)
    return PEAK_BF16_FLOPS[key] if key else None


# Host RAM per GPU when a hardware name does not say: DGX A100-80GB, H100 and H200 nodes carry 2 TB for 8 GPUs.
# Every plan prints the figure it assumed; --host_ram_gb replaces it (on a launch, the node's own RAM does).
HOST_RAM_PER_GPU = 250e9


@dataclass(frozen=True)
class Hardware:
    """`nodes` x `gpus_per_node` GPUs of `gpu_memory` bytes each, and `host_ram` bytes of CPU RAM per node."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int
    gpu: str | None = None
    name: str = ""
    host_ram: float = 0.0  # 0: HOST_RAM_PER_GPU x gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def host_ram_per_node(self) -> float:
        return self.host_ram or HOST_RAM_PER_GPU * self.gpus_per_node

    def with_nodes(self, nodes: int) -> Hardware:
        """The same node, `nodes` times."""
        spec = re.sub(r"^\d+x(?=\d+x)", "", self.name)  # '2x8xh100-80gb' -> '8xh100-80gb'
        return replace(self, nodes=nodes, name=spec if nodes == 1 else f"{nodes}x{spec}")


NAMED_HARDWARE = ("8xh100-80gb", "8xa100-80gb", "8xa100-40gb", "8xh200-141gb", "1xh100-80gb", "2x8xh100-80gb")
HARDWARE_FORMS = "NxMEMgb (one node, e.g. 8x80gb) or NODESxNxMEMgb (e.g. 2x8x80gb), optionally with a GPU: 8xh100-80gb"
_HARDWARE_RE = re.compile(r"^(?:(\d+)x)?(\d+)x(?:([a-z][a-z0-9]*(?:-[a-z][a-z0-9]*)*)-)?(\d+(?:\.\d+)?)gb$")


class HardwareError(ValueError):
    """A `--hardware` value the planner cannot read."""


def parse_hardware(spec: str, host_ram_gb: float | None = None) -> Hardware:
    """'8xh100-80gb' -> 1 node x 8 GPUs x 80 GB; '2x8xh100-80gb' -> 2 nodes. GB is 1e9 bytes: a card sold as
    80 GB holds 80 GiB (85.9e9 bytes), less what the driver keeps, so reading the label as 1e9 errs on the
    safe side; a launch reads its GPUs by the same rule (`nominal_gpu_memory`)."""
    match = _HARDWARE_RE.match(spec.strip().lower())
    if not match:
        raise HardwareError(
            f"Unknown hardware {spec!r}. Valid: {', '.join(NAMED_HARDWARE)}, or a custom {HARDWARE_FORMS}."
        )
    nodes, gpus, gpu, memory = match.groups()
    if gpu is not None and gpu not in PEAK_BF16_FLOPS:  # a typo (h10) would be planned as a GPU of its own
        raise HardwareError(f"Unknown GPU {gpu!r} in hardware {spec!r}: known GPUs are "
                            f"{', '.join(sorted(PEAK_BF16_FLOPS))}, or give none ({HARDWARE_FORMS}).")
    if int(gpus) < 1 or (nodes is not None and int(nodes) < 1) or float(memory) <= 0:
        raise HardwareError(f"Hardware {spec!r} needs at least one node, one GPU and some memory.")
    if host_ram_gb is not None and not host_ram_gb > 0:
        raise HardwareError(f"--host_ram_gb must be > 0 (host RAM per node in GB), got {host_ram_gb}.")
    return Hardware(int(nodes or 1), int(gpus), int(float(memory) * 1e9), gpu, spec.strip().lower(),
                    (host_ram_gb or 0) * 1e9)


def nominal_gpu_memory(total_memory: int) -> int:
    """The label of a GPU that reports `total_memory` bytes, in the planner's 1e9-byte GB: a card reporting
    79.6 GiB plans as 80e9, as `--hardware 8x80gb` does. One capacity rule for the planner CLI and a launch.
    (Not yet checked against a real card's torch.cuda total_memory: no GPU has run this.)"""
    return int(round(total_memory / 2**30) * 1e9)

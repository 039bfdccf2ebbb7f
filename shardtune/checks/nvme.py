"""NVMe offload's start-up checks (ds_zero3_nvme_offload.yaml): a swap directory given exactly when the launch
swaps, and DeepSpeed's async_io op buildable here, so that neither fails long after the model loaded."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from shardtune.config import ConfigError, Recipe
from shardtune.launch import LaunchDescription


def check_nvme_path(recipe: Recipe, nvme_offloaded: Sequence[str], on_this_machine: bool = True) -> None:
    """NVMe offload needs --offload_nvme_path, and the flag needs NVMe offload: accelerate launch does not pass a
    YAML's nvme paths to the script, so DeepSpeed would write its swap files to ./none; the shipped JSON's
    nvme_path is "auto", which accelerate fills from the path the trainer sets. `nvme_offloaded`: the states the
    launch offloads to NVMe without a directory of their own (LaunchDescription.nvme_offloaded);
    `on_this_machine` false (a --dry_run): the directory is the training machine's, not looked for here."""
    path = recipe.offload_nvme_path
    if nvme_offloaded and not path:
        raise ConfigError(f"The accelerate config offloads the {' and '.join(nvme_offloaded)} states to NVMe: pass "
                          "--offload_nvme_path <directory on a local NVMe disk>.")
    if path and not nvme_offloaded:
        raise ConfigError("--offload_nvme_path is used only with NVMe offload (ds_zero3_nvme_offload.yaml): drop it "
                          "or launch with that config.")
    if on_this_machine and path and not os.path.isdir(path):
        raise ConfigError(f"--offload_nvme_path {path!r} is not a directory: create it on a local NVMe disk.")


@dataclass(frozen=True)
class AsyncIOReadiness:
    """DeepSpeed's verdict on its async_io op (NVMe offload's reads and writes) on this machine. Unless DeepSpeed was
    installed with it built (DS_BUILD_AIO=1), the first rank to swap compiles it, long after the model loaded:
    against libaio, and on a GPU as a CUDA op, with the CUDA toolkit's nvcc."""

    prebuilt: bool
    libaio: bool  # AsyncIOBuilder().is_compatible(): libaio's header and library compile and link
    missing_toolkit: str | None = None  # on a GPU, why DeepSpeed finds no CUDA toolkit to compile with

    @classmethod
    def of_this_machine(cls, has_gpu: bool) -> AsyncIOReadiness:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.ops.op_builder.builder import CUDAOpBuilder, MissingCUDAException, installed_cuda_version

        if installed_ops.get("async_io", False):
            return cls(prebuilt=True, libaio=True)
        builder = AsyncIOBuilder()
        missing_toolkit = None
        if has_gpu and isinstance(builder, CUDAOpBuilder):  # built for the CPU where torch sees no GPU
            try:
                installed_cuda_version()
            except MissingCUDAException as error:
                missing_toolkit = str(error)
        return cls(prebuilt=False, libaio=builder.is_compatible(verbose=False), missing_toolkit=missing_toolkit)


def check_async_io(readiness: AsyncIOReadiness) -> None:
    """NVMe offload's async_io op can be built here: refused before the model loads rather than at the first swap."""
    if readiness.prebuilt:
        return
    if not readiness.libaio:
        raise ConfigError("NVMe offload needs DeepSpeed's async_io op, which builds against libaio, and DeepSpeed "
                          "cannot compile and link a libaio call here: install libaio-dev (apt-get install "
                          "libaio-dev; libaio-devel on RHEL) and a C compiler, or point CFLAGS and LDFLAGS at a "
                          "libaio built from source, or launch with ds_zero3_cpu_offload.yaml.")
    if readiness.missing_toolkit:
        raise ConfigError(f"NVMe offload needs DeepSpeed's async_io op, which compiles as a CUDA op on a GPU node, "
                          f"and no CUDA toolkit was found ({readiness.missing_toolkit}): install the CUDA toolkit "
                          "(nvcc) matching torch's CUDA and set CUDA_HOME, or install DeepSpeed with the op built "
                          "(DS_BUILD_AIO=1 pip install deepspeed).")


def offloads_to_nvme(launch: LaunchDescription) -> bool:
    settings = launch.deepspeed_settings
    return launch.uses_deepspeed and "nvme" in (settings.get("offload_optimizer"), settings.get("offload_param"))

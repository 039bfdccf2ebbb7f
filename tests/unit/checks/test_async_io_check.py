"""NVMe offload's async_io op is judged before the model loads: DeepSpeed's own verdict (AsyncIOBuilder's
compile-and-link test of libaio; on a GPU, the CUDA toolkit it compiles the op with), one line naming the fix.

This machine has libaio and a compiler, so the refusal is reached honestly in two ways: the check given each
verdict DeepSpeed can return, and DeepSpeed's real builder run with CC=/bin/false (its test program then does not
compile, which is what it reports on a node without libaio-dev)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from shardtune.checks.nvme import AsyncIOReadiness, check_async_io
from shardtune.checks.startup import check_machine
from shardtune.config import ConfigError, Problems, Recipe
from shardtune.launch import LaunchDescription

LIBAIO_FIX = "install libaio-dev (apt-get install libaio-dev"


def deepspeed_launch(optimizer: str, param: str) -> LaunchDescription:
    return LaunchDescription(world_size=2, uses_deepspeed=True, deepspeed_settings=MappingProxyType(
        {"stage": 3, "offload_optimizer": optimizer, "offload_param": param, "nvme_path": {}}))


def refusal(readiness: AsyncIOReadiness) -> list[str]:
    with pytest.raises(ConfigError) as error:
        check_async_io(readiness)
    return error.value.messages


def test_without_libaio_one_line_names_the_package():
    (message,) = refusal(AsyncIOReadiness(prebuilt=False, libaio=False))
    assert "\n" not in message and message.startswith("NVMe offload needs DeepSpeed's async_io op")
    assert LIBAIO_FIX in message and "ds_zero3_cpu_offload.yaml" in message


def test_on_a_gpu_without_the_cuda_toolkit_one_line_names_it():
    (message,) = refusal(AsyncIOReadiness(prebuilt=False, libaio=True,
                                          missing_toolkit="CUDA_HOME does not exist, unable to compile CUDA op(s)"))
    assert "\n" not in message and "(CUDA_HOME does not exist, unable to compile CUDA op(s))" in message
    assert "install the CUDA toolkit (nvcc)" in message and "DS_BUILD_AIO=1" in message


def test_a_prebuilt_op_or_a_buildable_one_passes():
    check_async_io(AsyncIOReadiness(prebuilt=True, libaio=False, missing_toolkit="no nvcc"))
    check_async_io(AsyncIOReadiness(prebuilt=False, libaio=True))


@pytest.mark.parametrize("optimizer, param", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "none")])
def test_the_machine_check_asks_deepspeed_for_an_nvme_launch(optimizer, param, monkeypatch):
    recipe = Recipe(use_cpu=True)
    problems = Problems()
    check_machine(recipe, problems, False, deepspeed_launch(optimizer, param))
    assert problems.messages == []  # libaio-dev is installed here
    monkeypatch.setenv("CC", "/bin/false")  # DeepSpeed's libaio probe cannot compile: its verdict is "no"
    check_machine(recipe, problems, False, deepspeed_launch(optimizer, param))
    assert len(problems.messages) == 1 and LIBAIO_FIX in problems.messages[0]


@pytest.mark.parametrize("launch", [deepspeed_launch("cpu", "cpu"), LaunchDescription(world_size=2)],
                         ids=["cpu-offload", "ddp"])
def test_the_machine_check_leaves_launches_without_nvme_alone(launch, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    problems = Problems()
    check_machine(Recipe(use_cpu=True), problems, False, launch)
    assert problems.messages == []

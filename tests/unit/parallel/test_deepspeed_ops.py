"""A launch names, before DeepSpeed compiles them, the ops it loads that are not built: minutes of silence on a few
cores otherwise (make demo builds the demo's op alone; the rest are built on first use)."""

from __future__ import annotations

import os

import pytest

from shardtune.parallel.deepspeed_ops import compile_notice, op_builders
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config

CONFIG = "accelerate_configs/ds_zero3_offload_optimizer.yaml"


def strategy_of(name: str):
    return read_accelerate_config(f"{CONFIGS_DIR}/{name}.yaml")


@pytest.mark.parametrize(("config", "builders"), [
    ("ddp", ()),
    ("fsdp_full_shard", ()),
    ("ds_zero3", ("ShareMemCommBuilder",)),
    ("ds_zero3_offload_optimizer", ("ShareMemCommBuilder", "CPUAdamBuilder")),
    ("ds_zero3_nvme_offload", ("ShareMemCommBuilder", "CPUAdamBuilder", "AsyncIOBuilder")),
])
def test_ops_a_config_loads(config: str, builders: tuple[str, ...]) -> None:
    assert op_builders(strategy_of(config)) == builders


def test_unbuilt_ops_named_before_they_compile(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built here
    assert compile_notice(strategy_of("ds_zero3_offload_optimizer"), CONFIG) == (
        "DeepSpeed compiles its deepspeed_shm_comm, cpu_adam ops before the first step (once per machine, minutes on "
        f"a few cores): to build them ahead, python scripts/build_deepspeed_ops.py --config {CONFIG}.")
    assert compile_notice(strategy_of("ddp"), "accelerate_configs/ddp.yaml") is None
    assert list(tmp_path.iterdir()) == []  # looking made no folder
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")  # as jit_load leaves it
    assert compile_notice(strategy_of("ds_zero3_offload_optimizer"), CONFIG) == (
        "DeepSpeed compiles its cpu_adam op before the first step (once per machine, minutes on a few cores): to "
        f"build it ahead, python scripts/build_deepspeed_ops.py --config {CONFIG}.")
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert compile_notice(strategy_of("ds_zero3_offload_optimizer"), CONFIG) is None


def test_default_extensions_root_is_torchs(monkeypatch) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    from shardtune.parallel.deepspeed_ops import extensions_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert os.path.dirname(_get_build_directory("deepspeed_shm_comm", verbose=False)) == extensions_root()

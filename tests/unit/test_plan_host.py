"""Host RAM per node as the libraries allocate it: torch's pinned-memory allocator's rounding (and the setting a
DeepSpeed launch makes so that DeepSpeed's pinned buffers are not rounded), the optimizer shards a resumed
DeepSpeed run loads, and the final export's gathered model."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from transformers import LlamaForCausalLM

from shardtune.flops import builtin_configs, resolve_model
from shardtune.hardware import parse_hardware
from shardtune.optimizers import param_groups
from shardtune.plan.host import MB, PINNED_MAX_CACHED_MB, pinned_block_bytes
from shardtune.plan.planner import plan
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config
from tests.conftest import REPO

NODE = parse_hardware("8xh100-80gb")


def config(name: str):
    return read_accelerate_config(os.path.join(CONFIGS_DIR, f"{name}.yaml"))


def power_of_two_ceil(nbytes: int) -> int:
    """c10::llvm::PowerOf2Ceil, which CachingHostAllocator.h's `allocate` applies to a request."""
    return 1 << (nbytes - 1).bit_length()


@pytest.fixture(scope="module")
def llama70b() -> torch.nn.Module:
    with torch.device("meta"):
        return LlamaForCausalLM(builtin_configs()["llama-3.1-70b"])


class Partition:
    """A parameter's ZeRO-3 partition as `_create_fp16_sub_groups` reads it: ceil(numel / N) elements."""

    def __init__(self, numel: int, world: int) -> None:
        self.elements = -(-numel // world)

    def partition_numel(self) -> int:
        return self.elements


def deepspeed_pinned_buffers(model: torch.nn.Module, world: int, sub_group_size: int) -> list[int]:
    """ZeRO-3 offload_optimizer's pinned buffers, cut by DeepSpeed's own `_create_fp16_sub_groups` over the
    trainer's parameter groups: the flat fp32 gradient partition and one fp32 buffer per sub-group."""
    cutter = SimpleNamespace(sub_group_size=sub_group_size)
    buffers, flat = [], 0
    for group in param_groups(model, 0.0):
        partitions = [Partition(p.numel(), world) for p in group["params"]]
        flat += 4 * sum(p.partition_numel() for p in partitions)
        for sub_group in DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(cutter, partitions):
            buffers.append(4 * sum(p.partition_numel() for p in sub_group))
    return [flat, *buffers]


def test_a_pinned_block_is_the_next_power_of_two_up_to_the_cache_limit():
    limit = PINNED_MAX_CACHED_MB * MB
    for nbytes in (1, 4096, 4097, limit - 1, limit, limit + 1, 35_276_853_248):
        assert pinned_block_bytes(nbytes) == power_of_two_ceil(nbytes)
        assert pinned_block_bytes(nbytes, limit) == (power_of_two_ceil(nbytes) if nbytes <= limit else nbytes)
    assert pinned_block_bytes(35_276_853_248) == 2**36  # the 35.3 GB partition takes 68.7 GB


def test_deepspeed_pins_through_torch_s_caching_host_allocator():
    """The setting acts on DeepSpeed's pins because its CUDA accelerator pins with `tensor.pin_memory()` (unless
    DS_PIN_MEMORY_BACKEND=native, DeepSpeed's own page-locked allocator)."""
    assert "_torch_pin_memory" not in vars(CUDA_Accelerator)
    assert "tensor.pin_memory()" in inspect.getsource(DeepSpeedAccelerator._torch_pin_memory)


@pytest.mark.parametrize("environment", [None, "pinned_max_cached_size_mb:64"])
def test_a_deepspeed_launch_sets_the_pinned_cache_limit_unless_the_environment_does(environment):
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env["PYTHONPATH"] = str(REPO)
    if environment:
        env["PYTORCH_ALLOC_CONF"] = environment
    code = ("import torch; from shardtune.distributed import exact_pinned_host_memory; "
            "exact_pinned_host_memory(); print(torch._C._accelerator_getAllocatorSettings())")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            check=True)
    expected = environment or f"pinned_max_cached_size_mb:{PINNED_MAX_CACHED_MB}"
    assert result.stdout.strip().splitlines()[-1] == expected


def test_pinned_rounding_is_planned_as_the_allocator_takes_it(llama70b):
    """ZeRO-3 offload under shardtune's setting: only the blocks at most PINNED_MAX_CACHED_MB round up; under
    torch's defaults the same buffers would take 42 GB more per rank. FSDP's CPU offload keeps torch's defaults:
    each parameter's shard (torch.chunk's first chunk, as FSDP2 pads it) and its gradient round up."""
    world = NODE.world_size
    strategy = config("ds_zero3_offload_optimizer")
    buffers = deepspeed_pinned_buffers(llama70b, world, strategy.sub_group)
    limit = PINNED_MAX_CACHED_MB * MB
    planned = plan(resolve_model("llama-3.1-70b"), NODE, strategy).host_ram["pinned_rounding"]
    assert planned == NODE.gpus_per_node * sum(pinned_block_bytes(b, limit) - b for b in buffers)
    assert sum(power_of_two_ceil(b) - b for b in buffers) > 40e9  # what the launch setting saves per rank

    shards = [4 * torch.chunk(p, world)[0].numel() for p in llama70b.parameters()]
    fsdp = plan(resolve_model("llama-3.1-70b"), NODE, config("fsdp_full_shard_cpu_offload")).host_ram
    assert fsdp["pinned_rounding"] == NODE.gpus_per_node * 2 * sum(power_of_two_ceil(b) - b for b in shards)


def test_adam_states_loaded_into_a_fresh_optimizer_are_the_loaded_tensors(tmp_path):
    """Why a resume under CPU offload adds only the loaded master copy: the optimizer has no states before its
    first step, and load_state_dict keeps each loaded tensor already of the parameter's dtype and device."""
    param = torch.nn.Parameter(torch.ones(8))
    trained = torch.optim.AdamW([param])
    param.grad = torch.ones(8)
    trained.step()
    torch.save(trained.state_dict(), tmp_path / "optim.pt")
    fresh = torch.optim.AdamW([param])
    assert not fresh.state
    loaded = torch.load(tmp_path / "optim.pt")
    fresh.load_state_dict(loaded)
    assert fresh.state[param]["exp_avg"].data_ptr() == loaded["state"][0]["exp_avg"].data_ptr()


@pytest.mark.parametrize(("name", "loaded_per_param"), [
    ("ds_zero3_offload_optimizer", 12 - 8),  # the loaded m and v become the states CPU Adam has not made yet
    ("ds_zero3_nvme_offload", 12),  # all of the shard, before it is swapped out to NVMe
    ("ds_zero3", 12),  # all of the shard, before it is copied to the GPU
    ("fsdp_full_shard", 0),  # loaded on the device
])
def test_a_resume_loads_each_rank_s_zero_shard_into_host_ram(name, loaded_per_param):
    shape = resolve_model("llama-3.1-70b")
    found = plan(shape, NODE, config(name))
    assert found.host_ram["resume"] == pytest.approx(
        NODE.gpus_per_node * loaded_per_param * shape.params / NODE.world_size)
    resident = found.host_ram["offloaded_states"] + found.host_ram["swap_buffers"] + found.host_ram["pinned_rounding"]
    assert found.host_ram_per_node >= resident + found.host_ram["resume"]


def test_the_final_export_is_in_the_host_ram_fit():
    """405B on two nodes under NVMe offload: rank 0 gathers the 16-bit model (2 bytes per parameter) beside its
    node's offloaded states, which alone fit, and a resume loads 12 bytes per parameter / N on every rank."""
    shape = resolve_model("llama-3.1-405b")
    two_nodes = parse_hardware("2x8xh100-80gb")
    found = plan(shape, two_nodes, config("ds_zero3_nvme_offload"), micro_batch=2)
    training = found.host_ram["offloaded_states"] + found.host_ram["swap_buffers"] + found.host_ram["pinned_rounding"]
    assert training < found.host_ram_capacity
    assert found.host_ram["export"] == 2 * shape.params
    assert found.host_ram["resume"] == pytest.approx(8 * 12 * shape.params / 16)
    assert not found.host_ram_fits
    assert found.host_ram_per_node == pytest.approx(training + found.host_ram["resume"])
    zero1 = plan(resolve_model("llama-3.1-8b"), NODE, config("ds_zero1"))
    assert zero1.host_ram["export"] == NODE.gpus_per_node * 2 * zero1.params  # every rank clones the module

"""Host RAM per node as the libraries allocate it: torch's pinned-memory allocator's rounding (and the setting a
DeepSpeed launch makes so that DeepSpeed's pinned buffers are not rounded), what a resumed DeepSpeed run copies
off its memory-mapped optimizer shards, and the final export's largest shard."""

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
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from huggingface_hub.serialization._base import parse_size_to_int
from transformers import LlamaForCausalLM

from shardtune.checkpoint.mmap_load import MmapCheckpointEngine, detach_optimizer
from shardtune.export.model import MAX_SHARD_SIZE, export_entries, export_layout
from shardtune.levers.optimizers import param_groups
from shardtune.models.flops import builtin_configs, resolve_model
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.host import MB, PINNED_MAX_CACHED_MB, pinned_block_bytes
from shardtune.plan.phases import EXPORT_SHARD_BYTES
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


@pytest.mark.parametrize("environment, expected", [
    (None, f"pinned_max_cached_size_mb:{PINNED_MAX_CACHED_MB}"),
    ("pinned_max_cached_size_mb:64", "pinned_max_cached_size_mb:64"),
    # torch resets every option the new settings leave out: the user's are kept beside the limit
    ("max_split_size_mb:256,garbage_collection_threshold:0.8",
     f"max_split_size_mb:256,garbage_collection_threshold:0.8,pinned_max_cached_size_mb:{PINNED_MAX_CACHED_MB}"),
])
def test_a_deepspeed_launch_sets_the_pinned_cache_limit_unless_the_environment_does(environment, expected):
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env["PYTHONPATH"] = str(REPO)
    if environment:
        env["PYTORCH_ALLOC_CONF"] = environment
    code = ("import torch; from shardtune.parallel.pinned_memory import exact_pinned_host_memory; "
            "exact_pinned_host_memory(); print(torch._C._accelerator_getAllocatorSettings())")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            check=True)
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


def test_a_mapped_load_leaves_adam_s_moments_on_the_file_until_detached(tmp_path):
    """Why a resume under CPU offload still copies the moments: the optimizer has no states before its first
    step, and load_state_dict keeps each loaded tensor already of the parameter's dtype and device, here a
    tensor mapped from the checkpoint file; detaching copies it into anonymous memory, one tensor at a time."""
    param = torch.nn.Parameter(torch.ones(1024))
    trained = torch.optim.AdamW([param])
    param.grad = torch.ones(1024)
    trained.step()
    path = tmp_path / "optim.pt"
    torch.save(trained.state_dict(), path)  # DeepSpeed's default: the zipfile format
    engine = MmapCheckpointEngine(TorchCheckpointEngine())
    fresh = torch.optim.AdamW([param])
    assert not fresh.state
    fresh.load_state_dict(engine.load(str(path), map_location="cpu"))
    moment = fresh.state[param]["exp_avg"]
    assert moment.untyped_storage().data_ptr() in engine.mapped_storages
    assert str(path) in open("/proc/self/maps").read()  # file-backed pages, not anonymous memory
    assert detach_optimizer(fresh, engine.mapped_storages) == 3  # exp_avg, exp_avg_sq and the step tensor
    assert fresh.state[param]["exp_avg"].untyped_storage().data_ptr() not in engine.mapped_storages
    torch.testing.assert_close(fresh.state[param]["exp_avg"], trained.state[param]["exp_avg"])
    del moment


def test_a_legacy_format_file_loads_unmapped(tmp_path):
    """A DeepSpeed config's checkpoint_serialization false writes torch's legacy format, which mmap refuses."""
    path = tmp_path / "legacy.pt"
    torch.save({"x": torch.ones(4)}, path, _use_new_zipfile_serialization=False)
    engine = MmapCheckpointEngine(TorchCheckpointEngine())
    assert torch.equal(engine.load(str(path))["x"], torch.ones(4))


@pytest.mark.parametrize("name", ["ds_zero3_offload_optimizer", "ds_zero3_nvme_offload", "ds_zero3",
                                  "fsdp_full_shard"])
def test_a_resume_adds_only_the_largest_moment_copied_off_the_mapped_shard(name, llama70b):
    """Under CPU offload, the largest optimizer sub-group's fp32 moment, as DeepSpeed's own
    `_create_fp16_sub_groups` cuts the trainer's parameter groups; the mapped rest is page cache. On the GPU
    or NVMe every loaded tensor is copied into its buffer: nothing; FSDP loads on the device."""
    shape = resolve_model("llama-3.1-70b")
    strategy = config(name)
    found = plan(shape, NODE, strategy)
    largest_moment = 0
    if name == "ds_zero3_offload_optimizer":
        largest_moment = max(deepspeed_pinned_buffers(llama70b, NODE.world_size, strategy.sub_group)[1:])
    assert found.host_ram["resume"] == NODE.gpus_per_node * largest_moment
    resident = found.host_ram["offloaded_states"] + found.host_ram["swap_buffers"] + found.host_ram["pinned_rounding"]
    assert found.host_ram_per_node >= resident + found.host_ram["resume"]


def test_the_export_term_is_the_largest_output_shard(llama70b):
    """The export's shards as the code plans them (huggingface_hub over the model's tensors, tied weights
    dropped): the planned term bounds the largest and exceeds it by less than one tensor; a model under
    MAX_SHARD_SIZE is one shard, all of it."""
    assert parse_size_to_int(MAX_SHARD_SIZE) == EXPORT_SHARD_BYTES
    layout = export_layout(llama70b, export_entries(llama70b), torch.bfloat16)
    entries = export_entries(llama70b)
    shard_bytes = [sum(2 * entries[name].numel() for name in names) for names in layout.filename_to_tensors.values()]
    shape = resolve_model("llama-3.1-70b")
    planned = plan(shape, NODE, config("ds_zero3_offload_optimizer")).host_ram["export"]
    largest_tensor = 2 * max(tensor.numel() for tensor in entries.values())
    assert max(shard_bytes) <= planned < max(shard_bytes) + largest_tensor
    small = resolve_model("llama-3.2-1b")
    with torch.device("meta"):
        model = LlamaForCausalLM(builtin_configs()["llama-3.2-1b"])
    entries = export_entries(model)
    assert "lm_head.weight" not in entries  # tied to the embedding
    total = sum(2 * tensor.numel() for tensor in entries.values())
    assert export_layout(model, entries, torch.bfloat16).metadata["total_size"] == total
    assert plan(small, NODE, config("ds_zero3")).host_ram["export"] == total


def test_405b_fits_two_nodes_with_the_streamed_export_and_mapped_resume():
    """405B on two nodes under NVMe offload: the export holds one 5 GB shard beside the node's offloaded
    states, and the resume maps its shards (nothing copied: the optimizer is on NVMe)."""
    shape = resolve_model("llama-3.1-405b")
    two_nodes = parse_hardware("2x8xh100-80gb")
    found = plan(shape, two_nodes, config("ds_zero3_nvme_offload"), micro_batch=2)
    training = found.host_ram["offloaded_states"] + found.host_ram["swap_buffers"] + found.host_ram["pinned_rounding"]
    assert found.host_ram["export"] == EXPORT_SHARD_BYTES
    assert found.host_ram["resume"] == 0
    assert found.host_ram_fits
    assert found.host_ram_per_node == pytest.approx(training + found.host_ram["export"])
    zero1 = plan(resolve_model("llama-3.1-8b"), NODE, config("ds_zero1"))
    assert zero1.host_ram["export"] == EXPORT_SHARD_BYTES  # the main process alone, one shard

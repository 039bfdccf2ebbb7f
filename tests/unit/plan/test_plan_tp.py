"""Tensor parallelism in the planner (fsdp_tp.yaml, shardtune.plan.tensor): each GPU's states are its TP slice of
the linear weights over tp x dp_shard GPUs and the whole norms over dp_shard; the residual stream, the checkpointed
layer inputs and the logits whole; an all-reduce of one layer's hidden states beside the FSDP buffers of the
slice; the recommendation's order (no TP first, TP before offload), its refusals, and a launch's plan."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.launch import LaunchDescription
from shardtune.models.flops import resolve_model, shape_from_config
from shardtune.models.tiny_assets import tiny_llama_config
from shardtune.parallel.planned_launch import planned_launch_environment
from shardtune.plan.activations import (
    activation_bytes,
    layer_backward_bytes,
    loss_transient_bytes,
    saved_activation_bytes,
)
from shardtune.plan.buffers import buffers, freed_under_layer_gradients, gathered_layer_bytes
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.planner import plan
from shardtune.plan.search import Search, recommend
from shardtune.plan.states import Peft
from shardtune.plan.strategy import PlanError, read_accelerate_config
from shardtune.plan.tensor import activation_shape, sliced_shape
from tests.conftest import CONFIGS, REPO, free_port

TP = read_accelerate_config(str(CONFIGS / "fsdp_tp.yaml"), "bf16")
FULL_SHARD = read_accelerate_config(str(CONFIGS / "fsdp_full_shard.yaml"), "bf16")
# Llama-3.1-405B: 128 heads, 8 KV heads, MLP 53248, vocabulary 128256, all multiples of 8: every slice is exact.
SHAPE = resolve_model("llama-3.1-405b")
FOUR_NODES = parse_hardware("4x8xh100-80gb")
N = 4096  # tokens of one micro-batch


def planned(hardware=FOUR_NODES, **options):
    return plan(SHAPE, hardware, TP, micro_batch=1, seq=N, checkpointing=True, **options)


def test_the_config_splits_layers_over_a_node():
    assert (TP.kind, TP.shard, TP.tensor_parallel, TP.ram_efficient_loading) == ("fsdp", 3, 8, True)
    assert "each layer split over 8 GPUs (tensor parallel), its slices sharded over 4 GPUs" in planned().layout


def test_linear_weights_divide_by_tp_times_dp_and_norms_by_dp_alone():
    norms = (2 * SHAPE.layers + 1) * SHAPE.hidden
    linear = SHAPE.params - norms
    chosen = planned()
    # FSDP2's fp32 sharded parameters: 4 bytes each, gradients the same, Adam's m and v 8.
    per_gpu = linear / 32 + norms / 4
    assert chosen.per_gpu["weights"] == pytest.approx(4 * per_gpu)
    assert chosen.per_gpu["gradients"] == pytest.approx(4 * per_gpu)
    assert chosen.per_gpu["optimizer"] == pytest.approx(8 * per_gpu)
    # The same states as FSDP over all 32 GPUs, but for the norms, sharded over 4 only.
    whole = plan(SHAPE, FOUR_NODES, FULL_SHARD, 1, N, True)
    assert chosen.per_gpu["weights"] - whole.per_gpu["weights"] == pytest.approx(4 * norms * (1 / 4 - 1 / 32))


def test_layer_inputs_and_logits_are_whole_and_the_inner_activations_split():
    chosen = planned(chunked_cross_entropy=True)
    assert not chosen.chunked_cross_entropy  # the plain loss under TP, whatever the recipe says
    whole = activation_bytes(SHAPE, 1, N, "half", True, loss_tile=None)
    split = activation_bytes(activation_shape(SHAPE, 8), 1, N, "half", True, loss_tile=None)
    # Saved: every layer's checkpointed input (2·n·h), the head's whole fp32 log-probabilities: not divided by tp.
    assert split["saved"] == whole["saved"]
    assert whole["saved"] > SHAPE.layers * 2 * N * SHAPE.hidden + 4 * N * SHAPE.vocab
    # The loss over the whole logits; a layer's recomputed attention and MLP in 1/8 of the heads and width.
    assert split["loss"] == loss_transient_bytes(SHAPE, N, "half")
    assert split["layer"] < whole["layer"]
    inner = 2 * 2 * N * SHAPE.intermediate  # the MLP backward's two intermediate-size gradients
    assert layer_backward_bytes(activation_shape(SHAPE, 8), 1, N, "half", False) == inner // 8
    assert chosen.per_gpu["activations"] == split["total"] == split["saved"] + split["loss"]


# A tiny Llama whose logits outweigh a layer (vocabulary 512 against hidden 64), split over 2 ranks: 4 heads and 2
# key/value heads each (SDPA repeats them under the padding mask), 88 of the MLP's 176.
SAVED_CONFIG = dict(vocab_size=512, num_attention_heads=8, num_key_value_heads=4)
SAVED_BATCH, SAVED_SEQ = 4, 24


def saved_under_tp(rank: int, port: str, out: str) -> None:
    """One rank of a 2-rank gloo group: the tiny model split by the trainer (apply_tensor_parallel), one padded
    forward with labels; rank 0 writes the bytes saved for backward (local storages, each once, parameters
    excluded) to `out`."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    from shardtune.parallel.tensor import apply_tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    config = tiny_llama_config(**SAVED_CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    model.train()

    def storage(tensor: torch.Tensor) -> torch.UntypedStorage:
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()

    weights = {storage(param).data_ptr() for param in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if storage(tensor).data_ptr() not in weights:
            saved.setdefault(storage(tensor).data_ptr(), storage(tensor).nbytes())
        return tensor

    ids = torch.randint(3, config.vocab_size, (SAVED_BATCH, SAVED_SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    if rank == 0:
        Path(out).write_text(json.dumps(sum(saved.values())))
    dist.destroy_process_group()


def test_what_a_split_model_saves_is_the_planned_activation_shape(tmp_path):
    """The trainer's TP split (transformers' plan on 2 gloo ranks, fp32, SDPA with a padding mask) saves for
    backward what saved_activation_bytes plans for activation_shape: the inner activations at 1/tp of the heads
    and MLP width, the residual stream and the fp32 log-probabilities of the gathered logits whole, byte for byte
    but the loss scalar; the vocabulary split as the weights are (sliced_shape) would plan the logits at half."""
    out, port = tmp_path / "saved.json", free_port()
    code = ("import sys; from tests.unit.plan.test_plan_tp import saved_under_tp as run; "
            "run(int(sys.argv[1]), *sys.argv[2:])")
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(port), str(out)], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for rank in ranks:
        _, stderr = rank.communicate(timeout=300)
        assert rank.returncode == 0, stderr[-3000:]
    measured = json.loads(out.read_text())
    shape = shape_from_config(tiny_llama_config(**SAVED_CONFIG))
    planned = saved_activation_bytes(activation_shape(shape, 2), SAVED_BATCH, SAVED_SEQ, "fp32", False)
    assert abs(planned - measured) <= 8, (planned, measured)
    split_logits = saved_activation_bytes(sliced_shape(shape, 2), SAVED_BATCH, SAVED_SEQ, "fp32", False)
    assert planned - split_logits == 4 * SAVED_BATCH * SAVED_SEQ * shape.vocab // 2
    assert planned - split_logits > 0.1 * measured


def test_tp_alone_plans_the_export_s_gather_as_fsdp2_does():
    """TP alone runs under DDP's config, but every parameter is a DTensor: the final export's full_tensor() gathers
    the largest one whole on every rank, as under FSDP2 (the embedding: 4 bytes x vocab x hidden in fp32)."""
    alone = dataclasses.replace(read_accelerate_config(str(CONFIGS / "ddp.yaml"), "bf16"), tensor_parallel=8)
    chosen = plan(SHAPE, parse_hardware("8xh100-80gb"), alone, 1, N, True, export_bytes=4)
    assert chosen.phases["save"]["gathered"] == 4 * SHAPE.vocab * SHAPE.hidden


def test_buffers_are_the_slice_s_plus_one_layer_s_all_reduce():
    sliced = sliced_shape(SHAPE, 8)
    assert sliced.params == pytest.approx((SHAPE.params - (2 * SHAPE.layers + 1) * SHAPE.hidden) / 8
                                          + (2 * SHAPE.layers + 1) * SHAPE.hidden)
    # FSDP2 gathers a layer's TP slice: its linear weights / 8, its two norms whole, in bf16.
    layer_slice = SHAPE.layer_matmul_params / 8 + 2 * SHAPE.hidden
    assert gathered_layer_bytes(TP, sliced) == 2 * layer_slice
    expected = (buffers(TP, sliced, sliced.params, 4, "half")
                - freed_under_layer_gradients(TP, sliced, 1, N, "half") + 2 * N * SHAPE.hidden)
    assert planned().per_gpu["buffers"] == pytest.approx(expected)


def test_host_ram_loads_one_whole_copy_per_node():
    chosen = planned()
    assert chosen.host_ram["model_loading"] == 4 * SHAPE.params  # fp32, rank 0 of the node alone
    every_rank = plan(SHAPE, FOUR_NODES, dataclasses.replace(TP, ram_efficient_loading=False), 1, N, True)
    assert every_rank.host_ram["model_loading"] == 8 * 4 * SHAPE.params


@pytest.mark.parametrize(("strategy", "hardware", "options", "refusal"), [
    (dataclasses.replace(read_accelerate_config(str(CONFIGS / "ds_zero3.yaml")), tensor_parallel=8), FOUR_NODES, {},
     "FSDP2 only"),
    (TP, parse_hardware("8xh100-80gb"), {}, "dp_shard_size 1"),
    (dataclasses.replace(TP, shard_group=8), FOUR_NODES, {}, "hybrid sharding"),
    (TP, FOUR_NODES, {"peft": Peft()}, "--use_peft true"),
    (dataclasses.replace(TP, tensor_parallel=16), FOUR_NODES, {}, "key/value heads"),
])
def test_the_planner_refuses_what_the_trainer_refuses(strategy, hardware, options, refusal):
    with pytest.raises(PlanError, match=refusal):
        plan(SHAPE, hardware, strategy, 1, N, True, **options)


def test_405b_gets_a_tensor_parallel_plan_without_offload():
    search = Search(128, N, optim="adamw_torch", bf16_stochastic_round=False)
    found = recommend(SHAPE, parse_hardware("32x8xh100-80gb"), search)
    assert found.gpu_only and found.plan.config == "fsdp_tp" and found.plan.tensor_parallel == 8
    assert (found.plan.micro_batch, found.accumulation) == (1, 4)  # 128 rows over 32 data-parallel ranks
    # On one node nothing fits without offload; the message names the fewest nodes TP fits without it.
    message = recommend(SHAPE, parse_hardware("8xh100-80gb")).message
    assert "Without offload it fits on " in message
    assert message.split("Without offload it fits on ")[1].split(":")[1].strip().startswith("fsdp_tp")


@pytest.mark.parametrize("hardware", ["8xh100-80gb", "2x8xh100-80gb"])
def test_8b_prefers_plans_without_tensor_parallelism(hardware):
    found = recommend(resolve_model("llama-3.1-8b"), parse_hardware(hardware), Search(64, N))
    assert found.plan is not None and found.plan.tensor_parallel == 1 and found.plan.config != "fsdp_tp"


def test_a_launch_plans_its_tp_size_and_a_dry_run_its_nodes():
    env = planned_launch_environment(str(CONFIGS / "fsdp_tp.yaml"), 4, 8)
    assert (env["PARALLELISM_CONFIG_TP_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("8", "4")
    launch = LaunchDescription(world_size=32, local_world_size=8, uses_fsdp=True, dp_shard_size=4, tp_size=8)
    assert launch.strategy("bf16").tensor_parallel == 8

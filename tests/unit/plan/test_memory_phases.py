"""The planner's phases without a launch: torch AdamW's step transient measured in this process against
optimizer_step_bytes, and the planner's JSON listing every phase with the largest as its total. The launched
runs' peaks by phase against the plan are in tests/launch/test_memory_phases.py."""

from __future__ import annotations

import json

import pytest

from shardtune.models.flops import resolve_model
from shardtune.plan.phases import EXPORT_SHARD_BYTES, PHASES, optimizer_step_bytes
from shardtune.plan.strategy import Strategy
from tests.conftest import CONFIGS


def step_rise(model, optimizer) -> float:
    """The bytes one optimizer step allocates above what was live when it started, at its peak (the profiler's
    allocator events, shardtune.profiling)."""
    from shardtune.profiling import PhaseRecorder

    recorder = PhaseRecorder()
    recorder.start()
    recorder.watch(model)
    recorder.begin("optimizer")
    optimizer.step()
    recorder.end()
    run = recorder.stop()["phases"]["optimizer"][0]
    return run["peak"] - run["start"]


@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_step_transient_is_planned(foreach, tiny_assets):
    """torch AdamW's own step on the tiny Llama, in this process, as the trainer groups its parameters: the
    bytes it allocates above the model states at its second step (states exist already) are optimizer_step_bytes,
    for foreach (the CUDA default, run here on CPU by request) and for the per-tensor loop."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.levers.optimizers import param_groups

    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0])
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, foreach=foreach)
    ids = torch.randint(3, model.config.vocab_size, (2, 16))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        rise = step_rise(model, optimizer)
        optimizer.zero_grad()
    planned = optimizer_step_bytes(Strategy("DDP", "ddp", 0, mixed_precision="no"), resolve_model(tiny_assets[0]),
                                   world=1, foreach=foreach)
    assert rise == pytest.approx(planned, rel=0.01)


def test_json_lists_every_phase_and_the_total_is_the_largest(capsys):
    """The planner CLI's --json: each phase's parts and total, the peak phase named, per_gpu["total"] its total
    (no longer the sum of forward/backward's components and anything else)."""
    from shardtune.plan.__main__ import main as plan_main

    code = plan_main(["--model", "llama-3.1-8b", "--hardware", "8xh100-80gb", "--config_file",
                      str(CONFIGS / "fsdp_full_shard.yaml"), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and set(result["phases"]) == set(PHASES)
    for parts in result["phases"].values():
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k not in ("total", "on_host")))
    assert result["per_gpu"]["total"] == result["phases"][result["peak_phase"]]["total"]
    assert result["per_gpu"]["total"] == max(parts["total"] for parts in result["phases"].values())
    assert result["phases"]["save"]["on_host"] == EXPORT_SHARD_BYTES  # one output shard on rank 0's host

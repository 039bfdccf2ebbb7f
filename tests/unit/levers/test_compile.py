"""--torch_compile in one process with the real inductor backend: a tiny Llama trains to the same losses and
gradient norms as eager over steps of varying length, its decoder layers share their compiled graphs (a model
compiles once whatever its depth) and varying lengths stop recompiling; generation runs eagerly. The flag checks."""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaForCausalLM

from shardtune.checks.values import check_compile_under, check_torch_compile
from shardtune.config import ConfigError, Recipe
from shardtune.levers.compile import compile_decoder_layers, eager_calls, local_compile_figures
from shardtune.levers.tiled_loss import chunked_token_loss
from shardtune.models.tiny_assets import tiny_llama_config
from tests.unit.checks.test_async_io_check import deepspeed_launch

LENGTHS = (24, 37, 29)  # one static graph at 24, one with the length dynamic at 37, reused at 29
COMPILED = Recipe(torch_compile=True)


def train(compiled: bool) -> list[tuple[float, float]]:
    """Three AdamW steps of a 2-layer fp32 tiny Llama with the tiled loss: (loss, gradient norm) of each."""
    torch.manual_seed(0)
    config = tiny_llama_config(40)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    if compiled:
        assert compile_decoder_layers(model, COMPILED) == config.num_hidden_layers
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    figures = []
    for length in LENGTHS:
        ids = torch.randint(3, config.vocab_size, (2, length), generator=data)
        mask = torch.ones_like(ids)
        mask[0, -5:] = 0  # a padded row
        labels = ids.masked_fill(mask == 0, -100)
        loss = chunked_token_loss(model, model, {"input_ids": ids, "attention_mask": mask, "labels": labels},
                                  (labels[:, 1:] != -100).sum())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        figures.append((loss.item(), norm.item()))
    with eager_calls():  # generation: a KV cache and one token at a time, never compiled
        model.config.use_cache = True
        model.generate(ids[:1, :8], max_new_tokens=3, do_sample=False)
    return figures


def test_inductor_trains_as_eager_and_compiles_each_layer_once():
    torch.set_num_threads(1)
    eager = train(compiled=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(compiled=True)
    # Inductor fuses each layer's elementwise ops and reductions (RMSNorm's mean, softmax) into its own kernels,
    # which sum in another order than eager's: fp32 rounding, about 1e-7 per op, grown by three AdamW steps.
    assert [loss for loss, _ in compiled] == pytest.approx([loss for loss, _ in eager], rel=1e-5)
    assert [norm for _, norm in compiled] == pytest.approx([norm for _, norm in eager], rel=1e-4)
    # Two frames for two layers over three lengths: the layers share each graph (regional compilation), the
    # second length makes it dynamic, the third length and generation compile nothing.
    figures = local_compile_figures()
    assert figures["compiled_frames"] == 2
    assert figures["compile_seconds"] > 0


def test_compile_flags_are_checked():
    check_torch_compile(dataclasses.replace(COMPILED, torch_compile_backend="aot_eager",
                                            torch_compile_mode="max-autotune-no-cudagraphs"))
    refusals = {"--torch_compile_backend": dataclasses.replace(Recipe(), torch_compile_backend="aot_eager"),
                "'reduce-overhead'": dataclasses.replace(COMPILED, torch_compile_mode="reduce-overhead"),
                "'cudagraphs'": dataclasses.replace(COMPILED, torch_compile_backend="cudagraphs"),
                "'inductr'": dataclasses.replace(COMPILED, torch_compile_backend="inductr"),
                # inductor issues a compiled layer's matmuls as mm.out: the selective policy would save none
                "mm.out": dataclasses.replace(COMPILED, gradient_checkpointing=True,
                                              gradient_checkpointing_mode="selective")}
    for named, recipe in refusals.items():
        with pytest.raises(ConfigError, match=named):
            check_torch_compile(recipe)


def test_the_plan_records_compilation_and_plans_it_as_eager(capsys):
    """`python -m shardtune.plan --torch_compile true`: the plan says so (--json's torch_compile, the table's
    header), and every byte is eager's (docs/planner.md)."""
    from shardtune.plan.__main__ import main

    plans = {}
    for flag in ("false", "true"):
        assert main(["--model", "llama-3.1-8b", "--config_file", "accelerate_configs/fsdp_full_shard.yaml",
                     "--torch_compile", flag, "--json"]) == 0
        plans[flag] = json.loads(capsys.readouterr().out)
    assert plans["true"]["torch_compile"] is True and plans["false"]["torch_compile"] is False
    assert plans["true"]["phases"] == plans["false"]["phases"]
    assert main(["--model", "llama-3.1-8b", "--config_file", "accelerate_configs/fsdp_full_shard.yaml",
                 "--torch_compile", "true"]) == 0
    assert "layers compiled (planned as eager)" in capsys.readouterr().out


def test_compile_under_zero3_is_refused_and_under_zero2_taken():
    """ZeRO-3's parameter hooks split a compiled layer at every module and recompile it up to dynamo's limit: the
    launch is refused in one line; ZeRO-1/2 have no such hooks."""
    zero3 = deepspeed_launch("none", "none")
    with pytest.raises(ConfigError) as error:
        check_compile_under(COMPILED, zero3)
    (message,) = error.value.messages
    assert message.startswith("--torch_compile under ZeRO-3") and "FSDP2, ZeRO-1/2 or DDP" in message
    check_compile_under(Recipe(), zero3)  # eager: nothing to refuse
    zero2 = dataclasses.replace(zero3, deepspeed_settings=MappingProxyType({**zero3.deepspeed_settings, "stage": 2}))
    check_compile_under(COMPILED, zero2)

"""The planner on each family's shape against a plain transformers loop in this process, as
tests/unit/plan/test_plan_accuracy.py measures Llama's: the peak of live bytes per phase of one step (the profiler's
allocator events) over the one-process plan of the same shape, batch, precision and recomputation. Each family's
extras are on at this size: Qwen3's q/k norms and own head_dim, Gemma 3's four norms in fp32, q/k norms, sliding
layers and soft-capped logits, OLMo 2's post-norms and width-wide q/k norms, SmolLM3's NoPE layers, Granite's
multipliers and logit scaling."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.model import enable_gradient_checkpointing
from shardtune.models.flops import shape_from_config
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.planner import plan
from shardtune.plan.strategy import Strategy
from tests.unit.plan.test_plan_accuracy import MLP_RATIO, measured_step, padded_batch

# Planned over measured. Llama's band is (0.99, 1.10); the families' lower end is 0.95: Gemma 3's step measures up to
# 3.6% over its plan without recomputation (its saved tensors are counted one by one in shardtune.plan.activations;
# what is left is the backward's transient of its fp32 norms), the others within Llama's band.
BAND = (0.95, 1.10)
SIZES = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
             intermediate_size=int(MLP_RATIO * 512), max_position_embeddings=1024, tie_word_embeddings=False,
             pad_token_id=0, use_cache=False)
EXTRAS = {
    "qwen3": dict(head_dim=48),
    "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=64, final_logit_softcapping=30.0,
                        layer_types=["sliding_attention", "full_attention"] * 2),
    "olmo2": {},
    "smollm3": dict(no_rope_layer_interval=2),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1),
}
# Per family: its model's own loss in fp32 without recomputation, where every saved tensor of its layers counts;
# Gemma 3's fp32 norms also in bf16, recomputed, with the tiled loss (the other families measured 1.03-1.04 there,
# as Llama does).
CASES = [(family, "fp32", False, False) for family in EXTRAS] + [("gemma3_text", "bf16", True, True)]


def planned_and_measured(family: str, settings: dict, precision: str, checkpointing: bool, tiled: bool, rows: int,
                         positions: int) -> tuple:
    """The plan of one process's step of the family's model built from `settings`, and that step's peaks by phase
    measured (tests/unit/plan/test_plan_accuracy.measured_step)."""
    torch.set_num_threads(1)
    config = AutoConfig.for_model(family, **settings)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    if checkpointing:
        enable_gradient_checkpointing(model, 1)
    measured = measured_step(model, padded_batch(settings["vocab_size"], rows, positions), precision, tiled)
    planned = plan(shape_from_config(model.config, family), parse_hardware("1x80gb"),
                   Strategy("one process", "ddp", 0, mixed_precision="bf16" if precision == "bf16" else "no"),
                   rows, positions, checkpointing, foreach=False, chunked_cross_entropy=tiled,
                   gradient_accumulation_steps=1)
    return planned, measured


@pytest.mark.parametrize("family,precision,checkpointing,tiled", CASES)
def test_each_family_is_planned_within_the_band(family, precision, checkpointing, tiled):
    planned, measured = planned_and_measured(family, {**SIZES, **EXTRAS[family]}, precision, checkpointing, tiled,
                                             rows=2, positions=256)
    ratios = {name: planned.phases[name]["total"] / measured[name] for name in ("forward_backward", "optimizer")}
    step = max(planned.phases[name]["total"] for name in ratios) / max(measured.values())
    print(f"{family} {precision} checkpointing={checkpointing} tiled={tiled}: step {step:.3f}; per phase {ratios}")
    for ratio in (step, *ratios.values()):
        assert BAND[0] <= ratio <= BAND[1], (ratios, step)


# Mixtures of experts (shardtune.models.experts) at a size where the routed activations outweigh the states, with
# the router's load-balancing loss in the model's loss (output_router_logits, as the trainer trains it): grouped_mm
# experts in fp32 without recomputation, under autocast (which leaves the experts in fp32) with the tiled loss and
# recomputation, and recomputed in fp32 (measured 1.00, 1.01 and 1.04).
MOE_SIZES = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=2000,
                 max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0, use_cache=False,
                 num_experts_per_tok=2, output_router_logits=True)
MOE_EXTRAS = {"qwen3_moe": dict(head_dim=32, num_experts=8, moe_intermediate_size=256),
              "mixtral": dict(num_local_experts=8, intermediate_size=256)}
MOE_CASES = [("qwen3_moe", "fp32", False, False), ("mixtral", "bf16", True, True), ("qwen3_moe", "fp32", True, False)]


@pytest.mark.parametrize("family,precision,checkpointing,tiled", MOE_CASES)
def test_each_mixture_of_experts_is_planned_within_the_band(family, precision, checkpointing, tiled):
    planned, measured = planned_and_measured(family, {**MOE_SIZES, **MOE_EXTRAS[family]}, precision, checkpointing,
                                             tiled, rows=4, positions=512)
    activations = planned.phases["forward_backward"]["activations"]
    assert activations > planned.phases["forward_backward"]["weights"]  # the experts' activations are measured
    ratios = {name: planned.phases[name]["total"] / measured[name] for name in ("forward_backward", "optimizer")}
    print(f"{family} {precision} checkpointing={checkpointing} tiled={tiled}: per phase {ratios}")
    for ratio in ratios.values():
        assert 0.99 <= ratio <= 1.10, ratios

"""--chunked_cross_entropy on one process: the tiled loss and its gradients against the plain loss, and the
memory it holds against the planner's term, measured with the profiler's allocator events."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardtune.checks.values import check_lora
from shardtune.config import ConfigError, Recipe
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.levers.tiled_loss import chunked_token_loss, shifted_labels
from shardtune.models.flops import shape_from_config
from shardtune.models.tiny_assets import tiny_llama_config
from shardtune.plan.activations import activation_bytes
from shardtune.step import token_loss

# fp32 sums in another order (one per tile, then the tiles): a few ulps of the loss, relative.
RTOL = 1e-6


def batch_of(vocab: int, rows: int, positions: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, positions), generator=generator)
    labels = input_ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[1, positions - 7:] = IGNORE_INDEX  # padding
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, positions - 7:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_of(model, batch: dict, targets: torch.Tensor, tile: int | None) -> torch.Tensor:
    """The plain loss (`tile` None) or the tiled one, as the step computes them."""
    if tile is None:
        return token_loss(model, model, batch, targets)
    return chunked_token_loss(model, model, batch, targets, tile)


def loss_and_grads(model, batch, targets, tile: int | None):
    model.zero_grad()
    loss = loss_of(model, batch, targets, tile)
    loss.backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tiled_loss_and_gradients_equal_the_plain_loss(tie):
    """Tiles of 16 positions over 3 x 40 (8 tiles, the last one short); tied embeddings (the head's weight is the
    embedding's) too. Only the tiled path's targets are the global count of a larger batch: the normalisation."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(97, tie_word_embeddings=tie), dtype=torch.float32)
    batch = batch_of(97, 3, 40)
    targets = torch.tensor(250.0)
    chunked, chunked_grads = loss_and_grads(model, batch, targets, tile=16)
    plain, plain_grads = loss_and_grads(model, batch, targets, tile=None)
    torch.testing.assert_close(chunked, plain, rtol=RTOL, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def measured_peak(model, batch: dict, targets: torch.Tensor, tile: int | None, mode: str) -> int:
    """The most the live tensor bytes rose over one loss forward and backward (the profiler's allocator events,
    as shardtune.profiling measures a run's phases), gradients included."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardtune.profiling import phase_figures

    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as session:
        with record_function("shardtune.phase:forward_backward"):
            with autocast:
                loss = loss_of(model, batch, targets, tile)
            loss.backward()
            del loss
    figures = phase_figures(session.profiler.kineto_results.experimental_event_tree(), [0])
    return figures["phases"]["forward_backward"][0]["peak"]


@pytest.mark.parametrize("mode", ["fp32", "half", "autocast"])
def test_the_planned_logits_term_is_one_tile_as_measured(mode):
    """A vocabulary of 8,192 over 2 x 512 positions, where the logits dominate the activations. The measured peak
    of a loss step grows by the planner's loss term from a tile of 128 positions to one of 256 (12 bytes x tile x
    vocab in every mode, and autocast's cast of the tile's input), and the plain loss's peak exceeds the tiled
    one's by the planner's difference."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = tiny_llama_config(8192)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if mode == "half" else torch.float32)
    batch = batch_of(8192, 2, 512)
    targets = (shifted_labels(batch["labels"]) != IGNORE_INDEX).sum().float()
    peaks = {tile: measured_peak(model, batch, targets, tile, mode) for tile in (None, 128, 256)}
    shape = shape_from_config(cfg)
    planned = {tile: activation_bytes(shape, 2, 512, mode, False, loss_tile=tile)["total"] for tile in peaks}
    one_tile = planned[256] - planned[128]
    # Under autocast each tile also casts its 128 positions of lm_head's fp32 input to bf16.
    assert one_tile == 12 * 128 * 8192 + (2 * 128 * cfg.hidden_size if mode == "autocast" else 0)
    assert peaks[256] - peaks[128] == pytest.approx(one_tile, rel=0.01), peaks
    # The plain loss's fp32 log-probabilities (saved) and gradients over all 1,024 positions, less one tile's.
    assert peaks[None] - peaks[128] == pytest.approx(planned[None] - planned[128], rel=0.05), (peaks, planned)
    assert peaks[128] < planned[128] + 4 * sum(param.numel() for param in model.parameters())


def test_an_adapter_on_the_head_is_refused_with_the_tiled_loss():
    """The tiled loss reads the head's weight, not a LoRA wrapper's output: an adapter there would never train."""
    recipe = Recipe(use_peft=True, lora_target_modules="q_proj, lm_head")
    with pytest.raises(ConfigError, match="add --chunked_cross_entropy false"):
        check_lora(recipe)
    check_lora(dataclasses.replace(recipe, chunked_cross_entropy=False))
    check_lora(dataclasses.replace(recipe, lora_target_modules="all-linear"))  # peft leaves the head out of it


def test_lora_adapters_get_the_plain_loss_s_gradients():
    """LoRA on every linear layer (peft leaves the head out of all-linear): the model the step calls is peft's
    wrapper, whose head is the base model's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_llama_config(97), dtype=torch.float32)
    adapters = LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(base, adapters)
    batch = batch_of(97, 3, 40)
    targets = torch.tensor(200.0)
    losses, grads = {}, {}
    for tile in (16, None):
        model.zero_grad()
        losses[tile] = loss_of(model, batch, targets, tile)
        losses[tile].backward()
        grads[tile] = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(losses[16], losses[None], rtol=RTOL, atol=0)
    assert grads[None] and grads[16].keys() == grads[None].keys()
    for name, grad in grads[None].items():
        torch.testing.assert_close(grads[16][name], grad, rtol=1e-5, atol=1e-7, msg=name)

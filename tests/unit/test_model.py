"""Gradient checkpointing changes memory, not gradients; the tiny assets load through from_pretrained; a saved
tokenizer carries nothing of how this process loaded it."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.config import Recipe
from shardtune.model import enable_gradient_checkpointing, load_tokenizer


def gradients(model_dir: str, interval: int | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if interval is not None:
        enable_gradient_checkpointing(model, interval)
    model.train()
    input_ids = torch.randint(4, model.config.vocab_size, (3, 24))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


def test_checkpointing_gives_same_gradients(tiny_assets):
    model_dir, _ = tiny_assets
    plain = gradients(model_dir, None)
    for interval in (1, 2):
        checkpointed = gradients(model_dir, interval)
        for name, grad in plain.items():
            torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_checkpointing_interval_selects_layers(tiny_assets):
    model_dir, _ = tiny_assets
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert enable_gradient_checkpointing(model, 1) == [0, 1]
    assert enable_gradient_checkpointing(model, 2) == [0]
    layers = model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]


@pytest.mark.parametrize(("interval", "expected_calls"), [(1, 2), (2, 2), (None, 1)])
def test_checkpointing_recomputes(tiny_assets, interval, expected_calls):
    """Layer 0 really runs twice per step when checkpointed (the design note's loop checked nothing)."""
    model_dir, _ = tiny_assets
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if interval is not None:
        enable_gradient_checkpointing(model, interval)
    model.train()
    calls = []
    # a pre-hook: non-reentrant recomputation stops as soon as the saved tensors are rebuilt, inside the MLP
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    input_ids = torch.randint(4, model.config.vocab_size, (2, 8))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert len(calls) == expected_calls


def test_tokenizer_round_trip(tiny_assets):
    model_dir, _ = tiny_assets
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("rev abc=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 9
    assert tokenizer.decode(ids, skip_special_tokens=True) == "rev abc="


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "online"])
def test_saved_tokenizer_config_holds_no_loading_arguments(tiny_assets, tmp_path, monkeypatch, offline):
    """The trainer saves its tokenizer beside every checkpoint and export: loaded under HF_HUB_OFFLINE=1 (as the
    tests and air-gapped clusters run), transformers would write `"local_files_only": true` into the exported
    tokenizer_config.json, and `is_local` either way."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    tokenizer = load_tokenizer(Recipe(model_name_or_path=tiny_assets[0]))
    tokenizer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "local_files_only" not in saved and "is_local" not in saved, saved
    assert saved["eos_token"] == "</s>"  # the tokenizer's own settings are still there
    assert AutoTokenizer.from_pretrained(tmp_path)("rev ab=")["input_ids"] == tokenizer("rev ab=")["input_ids"]

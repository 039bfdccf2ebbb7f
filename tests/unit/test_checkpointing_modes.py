"""--gradient_checkpointing_mode selective and --activation_offloading: what the selective policy keeps against the
planner's selective_layer_bytes, gradients equal to no recomputation, the refusals, and the planner's moves of
offloaded activations from the GPU to host RAM."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import LlamaForCausalLM

import shardtune.model
from shardtune.checks import check_activation_offloading, check_checkpointing_mode, check_choices
from shardtune.config import ConfigError, Recipe
from shardtune.flops import resolve_model, shape_from_config
from shardtune.hardware import parse_hardware
from shardtune.plan.__main__ import main
from shardtune.plan.activations import activation_bytes, offloaded_activation_bytes, selective_layer_bytes
from shardtune.plan.host import pinned_block_bytes
from shardtune.plan.planner import plan
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config
from shardtune.tiny import tiny_llama_config


def kept_by_policy(monkeypatch) -> dict[int, int]:
    """Storage pointer -> bytes of every output the selective policy keeps in a forward (not in the recompute),
    observed around shardtune.model.selective_policy's own decisions."""
    kept: dict[int, int] = {}

    def observed_contexts():
        policy = shardtune.model.selective_policy()

        def observe(ctx, func, *args, **kwargs):
            decision = policy(ctx, func, *args, **kwargs)
            if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
                for out in outputs:
                    if isinstance(out, torch.Tensor):
                        kept[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
            return decision

        return create_selective_checkpoint_contexts(observe)

    monkeypatch.setattr(shardtune.model, "selective_contexts", observed_contexts)
    return kept


def train_once(cfg, mode: str | None, dtype: torch.dtype, batch: int = 2, seq: int = 32):
    """One forward and backward of a padded batch: the loss and every parameter's gradient."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.config.use_cache = False
    if mode:
        shardtune.model.enable_gradient_checkpointing(model, 1, mode)
    model.train()
    ids = torch.randint(3, cfg.vocab_size, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -seq // 8:] = 0
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype,mode", [(torch.float32, "fp32"), (torch.bfloat16, "half")])
def test_selective_keeps_what_the_planner_counts_and_changes_no_gradient(monkeypatch, dtype, mode):
    """The recompute replays the same ops on the same inputs: in fp32 and bf16 on CPU the loss and every gradient are
    bit-identical to no recomputation (tolerance 0: any difference would be a different computation). What the
    policy keeps (4 matmul outputs and the attention kernel's output and logsumexp per layer) is exactly
    selective_layer_bytes."""
    torch.set_num_threads(1)
    cfg = tiny_llama_config(96, num_hidden_layers=3, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    kept = kept_by_policy(monkeypatch)
    plain_loss, plain_grads = train_once(cfg, None, dtype)
    loss, grads = train_once(cfg, "selective", dtype)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert sum(kept.values()) == cfg.num_hidden_layers * selective_layer_bytes(shape_from_config(cfg), 2, 32, mode)


def test_full_mode_keeps_nothing_beyond_layer_inputs(monkeypatch):
    kept = kept_by_policy(monkeypatch)
    cfg = tiny_llama_config(96, num_hidden_layers=2)
    cfg._attn_implementation = "sdpa"
    train_once(cfg, "full", torch.float32)
    assert kept == {}


def test_checkpointing_mode_refusals():
    with pytest.raises(ConfigError, match="--gradient_checkpointing_mode must be one of full, selective"):
        check_choices(Recipe(gradient_checkpointing_mode="op"))
    with pytest.raises(ConfigError, match="add --gradient_checkpointing true"):
        check_checkpointing_mode(Recipe(gradient_checkpointing=False, gradient_checkpointing_mode="selective"))
    check_checkpointing_mode(Recipe(gradient_checkpointing=True, gradient_checkpointing_mode="selective"))
    with pytest.raises(ConfigError, match="on CPU they are in host memory already"):
        check_activation_offloading(Recipe(activation_offloading=True, use_cpu=True), on_gpu=False)
    check_activation_offloading(Recipe(activation_offloading=True), on_gpu=True)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_offloading_moves_the_layers_saved_bytes_to_host_ram(checkpointing):
    """Per GPU the forward/backward activations shrink by offloaded_activation_bytes; per node host RAM grows by
    the ranks per node x their pinned blocks (with recomputation one layer input each, rounded by the caching host
    allocator to a power of two)."""
    shape, hardware = resolve_model("llama-3.1-8b"), parse_hardware("8xh100-80gb")
    strategy = read_accelerate_config(f"{CONFIGS_DIR}/fsdp_full_shard.yaml", "bf16")
    base = plan(shape, hardware, strategy, 1, 4096, checkpointing)
    moved = plan(shape, hardware, strategy, 1, 4096, checkpointing, activation_offloading=True)
    offloaded = offloaded_activation_bytes(shape, 1, 4096, "half", checkpointing)
    assert offloaded > 0
    assert base.per_gpu["activations"] - moved.per_gpu["activations"] == offloaded
    layer_input = 2 * 4096 * shape.hidden
    per_rank = shape.layers * pinned_block_bytes(layer_input) if checkpointing else offloaded
    assert moved.host_ram["offloaded_activations"] == 8 * per_rank
    assert moved.host_ram_per_node >= base.host_ram_per_node
    assert moved.to_json()["activation_offloading"] is True


def test_selective_plans_more_saved_and_less_recompute_than_full():
    shape = resolve_model("llama-3.1-8b")
    full = activation_bytes(shape, 1, 4096, "half", True)
    selective = activation_bytes(shape, 1, 4096, "half", True, selective=True)
    kept = shape.layers * selective_layer_bytes(shape, 1, 4096, "half")
    assert selective["saved"] - full["saved"] == kept
    assert selective["total"] > full["total"]


def test_planner_cli_takes_both_flags(capsys):
    import json

    args = ["--model", "llama-3.1-8b", "--config_file", f"{CONFIGS_DIR}/fsdp_full_shard.yaml", "--json"]
    main(args)
    full = json.loads(capsys.readouterr().out)
    main([*args, "--gradient_checkpointing_mode", "selective", "--activation_offloading", "true"])
    both = json.loads(capsys.readouterr().out)
    assert (both["gradient_checkpointing_mode"], both["activation_offloading"]) == ("selective", True)
    assert both["host_ram"]["offloaded_activations"] > 0 and "offloaded_activations" not in full["host_ram"]

"""--gradient_checkpointing_mode selective and --activation_offloading: what the selective policy keeps against the
planner's selective_layer_bytes, gradients equal to no recomputation, the refusals, and the planner's moves of
offloaded activations from the GPU to host RAM."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import LlamaForCausalLM

import shardtune.model
from shardtune.checks.values import check_activation_offloading, check_checkpointing_mode, check_choices
from shardtune.config import ConfigError, Recipe
from shardtune.models.flops import resolve_model, shape_from_config
from shardtune.models.tiny_assets import tiny_llama_config
from shardtune.plan.__main__ import main
from shardtune.plan.activations import (
    activation_bytes,
    layer_activation_bytes,
    offloaded_activation_bytes,
    selective_layer_bytes,
)
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.host import pinned_block_bytes
from shardtune.plan.planner import plan
from shardtune.plan.strategy import CONFIGS_DIR, PlanError, read_accelerate_config


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


OFFLOAD_MIN_BYTES = 1024  # TRL's OffloadActivations keeps smaller tensors on the GPU (its min_offload_size)


def saved_by_the_layers(mode: str | None, interval: int = 1, seq: int = 8) -> tuple[list[torch.Tensor], list, object]:
    """What the decoder layers hand to saved-tensor hooks entered around them (TRL's OffloadActivations packs what
    these see) in one forward under bf16 autocast, as DDP runs: the tensors of OFFLOAD_MIN_BYTES or more, the
    layers' inputs, and the config. `mode`: None for no recomputation, else every `interval`-th layer's mode.
    The hooks hand the graph a key, as TRL's do, and the list they key is emptied after the forward: a graph that
    holds, through its hooks, a tensor whose grad_fn is in that graph is a cycle through C++ that gc never collects."""
    torch.manual_seed(0)
    cfg = tiny_llama_config(96, num_hidden_layers=2)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    if mode:
        shardtune.model.enable_gradient_checkpointing(model, interval, mode)
    model.train()
    saved, inputs = [], []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or len(saved) - 1, saved.__getitem__)
    layers = model.model.layers
    handles = [layers[0].register_forward_pre_hook(lambda *_: hooks.__enter__()),
               layers[-1].register_forward_hook(lambda *_: hooks.__exit__(None, None, None)),
               *(layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for layer in layers)]
    with torch.autocast("cpu", torch.bfloat16):
        model(input_ids=torch.randint(3, 96, (1, seq)))
    for handle in handles:
        handle.remove()
    large = [t for t in saved if t.untyped_storage().nbytes() >= OFFLOAD_MIN_BYTES]
    saved.clear()  # the graph's unpack hook holds this list: emptied, it holds no tensor whose graph holds it
    return large, inputs, cfg


def weight_shaped(tensors: list[torch.Tensor], cfg) -> list[torch.Tensor]:
    linears = {(cfg.hidden_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size),
               (cfg.hidden_size, cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads)}
    return [t for t in tensors if t.dim() == 2 and tuple(sorted(t.shape)) in {tuple(sorted(s)) for s in linears}]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_layers_offload_their_inputs_alone(mode):
    """With every layer recomputed the offloading hooks see each layer's input and nothing else of OFFLOAD_MIN_BYTES
    (the checkpoint's own hooks take the rest; a selective policy's kept outputs stay in its cache): what
    offloaded_activation_bytes plans."""
    saved, inputs, cfg = saved_by_the_layers(mode)
    assert {t.untyped_storage().data_ptr() for t in saved} == {t.untyped_storage().data_ptr() for t in inputs}
    assert sum(t.untyped_storage().nbytes() for t in {id(t): t for t in inputs}.values()) == \
        offloaded_activation_bytes(shape_from_config(cfg), 1, 8, "autocast")


@pytest.mark.parametrize(("mode", "interval"), [(None, 1), ("full", 2)], ids=["no recomputation", "every 2nd layer"])
def test_a_layer_not_recomputed_saves_its_autocast_weight_copies(mode, interval):
    """Why --activation_offloading needs every layer recomputed: a layer that is not saves its weights (here
    autocast's bf16 copies; under FSDP2 and ZeRO-3 the gathered ones) for backward, which TRL's hooks would copy to
    the host at every step."""
    saved, _, cfg = saved_by_the_layers(mode, interval)
    copies = weight_shaped(saved, cfg)
    assert copies and all(t.dtype == torch.bfloat16 for t in copies)
    assert not weight_shaped(saved_by_the_layers("full")[0], cfg)


def test_checkpointing_mode_refusals():
    with pytest.raises(ConfigError, match="--gradient_checkpointing_mode must be one of full, selective"):
        check_choices(Recipe(gradient_checkpointing_mode="op"))
    with pytest.raises(ConfigError, match="add --gradient_checkpointing true"):
        check_checkpointing_mode(Recipe(gradient_checkpointing=False, gradient_checkpointing_mode="selective"))
    check_checkpointing_mode(Recipe(gradient_checkpointing=True, gradient_checkpointing_mode="selective"))
    with pytest.raises(ConfigError, match="--gradient_checkpointing_mode selective chooses what checkpointed layers "
                                          "keep and --gradient_checkpointing_interval 2 chooses which layers are "
                                          "checkpointed: add --gradient_checkpointing true, or drop them"):
        check_checkpointing_mode(Recipe(gradient_checkpointing=False, gradient_checkpointing_mode="selective",
                                        gradient_checkpointing_interval=2))
    with pytest.raises(ConfigError, match="on CPU they are in host memory already"):
        check_activation_offloading(Recipe(activation_offloading=True, use_cpu=True), on_gpu=False)
    check_activation_offloading(Recipe(activation_offloading=True), on_gpu=True)
    for recipe in (Recipe(activation_offloading=True, gradient_checkpointing=False),
                   Recipe(activation_offloading=True, gradient_checkpointing_interval=2)):
        with pytest.raises(ConfigError, match="a layer that is not recomputed saves its weights") as error:
            check_activation_offloading(recipe, on_gpu=True)
        assert len(error.value.messages) == 1
    with pytest.raises(ConfigError) as error:  # both problems at once
        check_activation_offloading(Recipe(activation_offloading=True, gradient_checkpointing=False), on_gpu=False)
    assert len(error.value.messages) == 2
    with pytest.raises(ConfigError, match="pinned and unpinned anew each micro-batch"):
        check_activation_offloading(Recipe(activation_offloading=True), on_gpu=True, deepspeed_offloads=True)


def test_offloading_moves_the_layers_inputs_to_host_ram():
    """Per GPU the forward/backward activations shrink by offloaded_activation_bytes; per node host RAM grows by
    the ranks per node x their pinned blocks (one layer input each, rounded by the caching host allocator to a
    power of two). Without recomputation the plan is refused, as the recipe is."""
    shape, hardware = resolve_model("llama-3.1-8b"), parse_hardware("8xh100-80gb")
    strategy = read_accelerate_config(f"{CONFIGS_DIR}/fsdp_full_shard.yaml", "bf16")
    base = plan(shape, hardware, strategy, 1, 4096, True)
    moved = plan(shape, hardware, strategy, 1, 4096, True, activation_offloading=True)
    offloaded = offloaded_activation_bytes(shape, 1, 4096, "half")
    layer_input = 2 * 4096 * shape.hidden
    assert offloaded == shape.layers * layer_input
    assert base.per_gpu["activations"] - moved.per_gpu["activations"] == offloaded
    assert moved.host_ram["offloaded_activations"] == 8 * shape.layers * pinned_block_bytes(layer_input)
    assert moved.host_ram_per_node >= base.host_ram_per_node
    assert moved.to_json()["activation_offloading"] is True
    with pytest.raises(PlanError, match="a layer that is not recomputed"):
        plan(shape, hardware, strategy, 1, 4096, False, activation_offloading=True)
    deepspeed_offload = read_accelerate_config(f"{CONFIGS_DIR}/ds_zero3_offload_optimizer.yaml", "bf16")
    with pytest.raises(PlanError, match="pinned and unpinned anew"):
        plan(shape, hardware, deepspeed_offload, 1, 4096, True, activation_offloading=True)


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
    # A recommendation with offloading searches recomputed layers only: 8B fits without recomputation otherwise.
    main(["--model", "llama-3.1-8b", "--json"])
    assert json.loads(capsys.readouterr().out)["gradient_checkpointing"] is False
    main(["--model", "llama-3.1-8b", "--activation_offloading", "true", "--json"])
    assert json.loads(capsys.readouterr().out)["gradient_checkpointing"] is True
    # Nor beside DeepSpeed's offload: 70B's recommendation with offloading is a plan without it.
    main(["--model", "llama-3.1-70b", "--activation_offloading", "true", "--optim", "adamw_torch", "--json"])
    recommended = json.loads(capsys.readouterr().out)
    assert not (recommended["config"].startswith("ds_") and "offload" in recommended["config"]), recommended


def test_planner_plans_the_checkpointing_interval(capsys):
    """--gradient_checkpointing_interval k: the layers not recomputed save what they save without recomputation
    (measured in tests/unit/plan/test_plan_accuracy.py); the plan says which layers, and refuses it without
    checkpointing, as the recipe does."""
    import json

    args = ["--model", "llama-3.1-8b", "--config_file", f"{CONFIGS_DIR}/fsdp_full_shard.yaml",
            "--per_device_train_batch_size", "4", "--json"]
    plans = {}
    for flags in (("--gradient_checkpointing", "true"), ("--gradient_checkpointing_interval", "4"),
                  ("--gradient_checkpointing", "false")):
        main([*args, *flags])
        plans[flags] = json.loads(capsys.readouterr().out)
    every, fourth, none = plans.values()
    assert fourth["gradient_checkpointing_interval"] == 4 and every["gradient_checkpointing_interval"] == 1
    shape = resolve_model("llama-3.1-8b")
    # 8 of 32 layers recomputed: the other 24 save a whole layer's activations each
    assert fourth["per_gpu"]["activations"] - every["per_gpu"]["activations"] == pytest.approx(
        24 * (layer_activation_bytes(shape, 4, 4096, "half") - 2 * 4 * 4096 * shape.hidden))
    assert every["per_gpu"]["total"] < fourth["per_gpu"]["total"] < none["per_gpu"]["total"]
    main([*args[:-1], "--gradient_checkpointing_interval", "4"])
    assert "checkpointing on (every 4th layer)" in capsys.readouterr().out
    main(["--model", "llama-3.1-8b", "--gradient_checkpointing", "true", "--gradient_checkpointing_interval", "2"])
    launch = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Launch:"))
    assert "--gradient_checkpointing_interval 2" in launch  # the recommendation's launch line keeps it
    assert main([*args, "--gradient_checkpointing", "false", "--gradient_checkpointing_interval", "2"]) == 2
    assert "--gradient_checkpointing_interval 2 chooses which layers are checkpointed" in capsys.readouterr().err

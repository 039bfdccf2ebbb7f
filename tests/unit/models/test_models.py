"""Each family's shape (shardtune.models) against transformers' own model: every built-in shape and every tiny
config built on the meta device, its parameters counted and listed in order; FLOPs per family by hand; the
refusals in one line."""

from __future__ import annotations

import types

import pytest
import torch

from shardtune.checks.model import check_family_levers
from shardtune.config import ConfigError, Recipe
from shardtune.levers.optimizers import param_groups
from shardtune.models.experts import MOE_MODEL_TYPES
from shardtune.models.families import FAMILIES, SUPPORTED_MODEL_TYPES
from shardtune.models.flops import BUILTIN_CONFIG_VALUES, ModelError, flops_per_token, resolve_model, shape_from_config
from shardtune.models.tiny import tiny_config_values
from shardtune.plan.optimizer_states import parameter_matrices
from shardtune.plan.states import parameter_sizes


def built(values: dict) -> tuple[object, torch.nn.Module]:
    """transformers' config and model of config.json `values`, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


def assert_counted(shape, model: torch.nn.Module) -> None:
    """The shape's count and its parameter list (elements, decayed) in model.parameters() order, as the planner's
    DeepSpeed sub-groups and optimizer states read them."""
    parameters = list(model.parameters())
    assert shape.params == sum(parameter.numel() for parameter in parameters)
    assert [numel for numel, _ in parameter_sizes(shape)] == [parameter.numel() for parameter in parameters]
    assert [rows * columns for rows, columns in parameter_matrices(shape)] == [p.numel() for p in parameters]
    decayed = {id(parameter) for parameter in param_groups(model, 0.1)[0]["params"]}
    assert [decay for _, decay in parameter_sizes(shape)] == [id(parameter) in decayed for parameter in parameters]


@pytest.mark.parametrize("name", list(BUILTIN_CONFIG_VALUES))
def test_builtin_shapes_count_the_model_built_on_meta(name):
    config, model = built(BUILTIN_CONFIG_VALUES[name])
    shape = resolve_model(name)
    assert_counted(shape, model)
    # The plain values (no transformers import) and transformers' config give one shape.
    assert shape_from_config(config, name) == shape


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_tiny_configs_count_the_model_built_on_meta(model_type):
    config, model = built({"model_type": model_type} | tiny_config_values(model_type, 40))
    assert_counted(shape_from_config(config), model)


def test_published_counts():
    """MISSION.md's counts, from the model built on the meta device."""
    assert resolve_model("Qwen/Qwen3-8B").params == 8_190_735_360
    assert resolve_model("google/gemma-3-12b").params == 11_766_034_176
    assert resolve_model("allenai/OLMo-2-1124-7B").params == 7_298_617_344


def test_gemma3_flops_count_the_sliding_windows_by_hand():
    shape = resolve_model("gemma-3-12b")
    assert (shape.layers, shape.sliding_layers, shape.sliding_window, shape.head_dim) == (48, 40, 1024, 256)
    layer = 3840 * 4096 + 2 * 3840 * 2048 + 4096 * 3840 + 3 * 3840 * 15360  # q, k, v, o over 16 x 256, MLP
    n = 48 * layer + 262208 * 3840  # + the tied lm_head: a matmul all the same
    assert shape.non_embedding_matmul_params == n
    # 8 global layers attend T = 4096 positions, 40 local ones their window of 1024
    attention = 12 * 16 * 256 * (8 * 4096 + 40 * 1024)
    assert flops_per_token(shape, 4096) == 6 * n + attention
    assert flops_per_token(shape, 512) == 6 * n + 12 * 16 * 256 * 48 * 512  # rows shorter than the window
    # Qwen3's head_dim (128) is not hidden / heads' for the 32B (5120 / 64 = 80): the attention term reads it
    qwen = resolve_model("qwen3-32b")
    assert flops_per_token(qwen, 4096) - 6 * qwen.non_embedding_matmul_params == 12 * 64 * 64 * 128 * 4096


def test_other_mixtures_of_experts_and_gemma3_multimodal_refused_in_one_line():
    for model_type, expected in (("qwen2_moe", "a mixture of experts"), ("olmoe", "a mixture of experts"),
                                 ("gemma3", "model_type gemma3_text")):
        with pytest.raises(ModelError, match=expected) as caught:
            shape_from_config(types.SimpleNamespace(model_type=model_type), "m")
        assert "\n" not in str(caught.value)


def refusals(recipe: Recipe, model_type: str, sp_size: int = 1, tp_size: int = 1, **config) -> list[str]:
    values = {"model_type": model_type} | tiny_config_values(model_type, 40) | config
    text = types.SimpleNamespace(**values, get_text_config=lambda: text)
    try:
        check_family_levers(recipe, text, sp_size, tp_size)
    except ConfigError as error:
        return error.messages
    return []


def test_family_levers_refused_each_in_one_line():
    recipe = Recipe(max_seq_length=64)
    for model_type, family in FAMILIES.items():
        messages = refusals(recipe, model_type, tp_size=2)
        assert bool(messages) == bool(family.tensor_parallel_refusal)
        assert all("\n" not in message and message.endswith(".") for message in messages)
    # Gemma 3's sliding layers under Ulysses: refused under SDPA, not under flash attention, nor rows within
    # the window
    (ulysses,) = refusals(recipe, "gemma3_text", sp_size=2)
    assert "Ulysses (sp_size 2) drops the attention mask" in ulysses
    assert refusals(Recipe(max_seq_length=64, attn_implementation="flash_attention_2"), "gemma3_text", sp_size=2) == []
    assert refusals(Recipe(max_seq_length=8), "gemma3_text", sp_size=2) == []
    assert refusals(recipe, "qwen3", sp_size=2) == []
    # DPO's log-probs would skip Granite's logit scaling and a Gemma soft-cap
    dpo = Recipe(max_seq_length=64, method="dpo")
    assert "logits_scaling" in refusals(dpo, "granite")[0]
    assert refusals(dpo, "gemma3_text") == [] and refusals(dpo, "qwen3") == []
    assert "final_logit_softcapping" in refusals(dpo, "gemma3_text", final_logit_softcapping=30.0)[0]


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_tiled_loss_is_each_familys_own_loss(model_type):
    """The tiled loss runs in place of the LM head: Granite's logit scaling and a Gemma soft-cap are applied as the
    model's forward applies them, so the loss equals transformers' own (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.levers.tiled_loss import chunked_token_loss

    overrides = {"final_logit_softcapping": 3.0} if model_type == "gemma3_text" else {}
    values = tiny_config_values(model_type, 40, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **values))
    ids = torch.randint(3, 40, (2, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    targets = (labels[:, 1:] != -100).sum()
    tiled = chunked_token_loss(model, model, {"input_ids": ids, "labels": labels}, targets, tile=5)
    torch.testing.assert_close(tiled, model(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)


def test_the_search_plans_no_axis_a_family_refuses():
    """The planner's search offers no layout the start-up checks would refuse for the family: ring attention over
    sliding layers, Ulysses over windows shorter than the row under SDPA, tensor parallelism where refused."""
    import os

    from shardtune.plan.search import Search, family_allows
    from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config

    def allowed(model: str, config: str, seq: int = 32768, attn: str = "sdpa") -> bool:
        strategy = read_accelerate_config(os.path.join(CONFIGS_DIR, f"{config}.yaml"))
        return family_allows(strategy, Search(64, seq, attn=attn), resolve_model(model))

    assert not allowed("gemma-3-12b", "ds_zero3_ulysses") and allowed("gemma-3-12b", "ds_zero3_ulysses", attn="flash")
    assert allowed("gemma-3-12b", "ds_zero3_ulysses", seq=1024)  # rows within the window
    assert not allowed("gemma-3-12b", "fsdp_cp") and allowed("qwen3-32b", "fsdp_cp")
    assert not allowed("qwen3-8b", "fsdp_tp") and not allowed("olmo-2-7b", "fsdp_tp") and allowed("llama-3.1-8b",
                                                                                                   "fsdp_tp")
    assert allowed("gemma-3-12b", "fsdp_full_shard")


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_lora_targets_and_checkpointing_modes_per_family(model_type):
    """LoRA's target names are the family's linear layers (the planner's adapter count is peft's), and both
    recomputation modes give the gradients of the plain backward (selective_policy saves matmul outputs by their
    order in the layer, which each family's forward keeps: q, k, v, o, gate, up, down)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.model import enable_gradient_checkpointing
    from shardtune.plan.states import Peft

    config = AutoConfig.for_model(model_type, **tiny_config_values(model_type, 40))
    if model_type not in MOE_MODEL_TYPES:  # LoRA is refused on a mixture of experts (tests/unit/models/test_experts)
        with torch.device("meta"):
            adapted = get_peft_model(AutoModelForCausalLM.from_config(config),
                                     LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
        trainable = sum(parameter.numel() for parameter in adapted.parameters() if parameter.requires_grad)
        assert Peft(4, "all-linear").trainable_params(shape_from_config(config)) == trainable
    ids = torch.randint(3, 40, (2, 12))
    gradients = {}
    for mode in (None, "full", "selective"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).train()
        if mode:
            enable_gradient_checkpointing(model, 1, mode)
        model(input_ids=ids, labels=ids).loss.backward()
        gradients[mode] = [parameter.grad for parameter in model.parameters()]
    for mode in ("full", "selective"):
        for plain, recomputed in zip(gradients[None], gradients[mode], strict=True):
            torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("model_type", [name for name in ("qwen3", "olmo2", "smollm3")])
def test_liger_patches_each_accepted_familys_instance(model_type, monkeypatch):
    """--use_liger_kernel on a family it accepts: Liger 0.8.5's patch for that model type replaces every norm's and
    MLP's forward of this model (Qwen3's q/k norms too), the loss stays shardtune's, and later models build their own
    classes. Liger's kernels need CUDA: their numerics are the GPU check's, not this test's."""
    import sys

    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.levers.liger import apply_liger_kernels

    config = AutoConfig.for_model(model_type, **tiny_config_values(model_type, 40))
    model = AutoModelForCausalLM.from_config(config)
    modeling = sys.modules[type(model).__module__]
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)  # Liger's stays otherwise
    norm_class = type(model.model.norm)
    apply_liger_kernels(model)
    # Liger's OLMo 2 patch leaves the q/k norms (over all heads' width) as transformers builds them.
    skipped = ("q_norm", "k_norm") if model_type == "olmo2" else ()
    norms = [module for name, module in model.named_modules() if name.endswith("norm") and not name.endswith(skipped)]
    assert len(norms) == 1 + config.num_hidden_layers * (2 + 2 * (model_type == "qwen3"))
    assert all(norm.forward.__func__ is LigerRMSNorm.forward for norm in norms)
    assert all(layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward for layer in model.model.layers)
    assert model.get_output_embeddings().forward.__func__ is torch.nn.Linear.forward
    assert type(AutoModelForCausalLM.from_config(config).model.norm) is norm_class


def test_family_norms_planned_beyond_llamas():
    """Llama's layer is planned as before (no norm beyond its two); under Liger a q/k norm Liger's patch leaves
    (OLMo 2's) is planned as the plain norm it stays, one it replaces (Qwen3's) as Liger's."""
    from shardtune.plan.activations import family_norm_bytes

    for name in ("llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "smollm3-3b", "granite-3.3-8b"):
        assert family_norm_bytes(resolve_model(name), 4096, "half") == 0
    olmo, qwen = resolve_model("olmo-2-7b"), resolve_model("qwen3-8b")
    assert family_norm_bytes(olmo, 4096, "half", liger=True) == family_norm_bytes(olmo, 4096, "half") > 0
    assert 0 < family_norm_bytes(qwen, 4096, "half", liger=True) < family_norm_bytes(qwen, 4096, "half")

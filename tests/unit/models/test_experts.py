"""The mixtures of experts (shardtune.models.experts, shardtune.models.routing): their published counts and FLOPs by
hand, the trained loss and its gradients equal to transformers' own (its cross-entropy plus router_aux_loss_coef x
its load-balancing loss), the routed tokens counted once per layer and expert, and the refusals in one line."""

from __future__ import annotations

import os
import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.checks.model import check_family_levers
from shardtune.config import ConfigError, Recipe
from shardtune.levers.liger import check_liger_model
from shardtune.model import enable_gradient_checkpointing
from shardtune.models.experts import MOE_MODEL_TYPES, MOE_REFUSALS
from shardtune.models.flops import ModelError, flops_per_token, resolve_model, shape_from_config
from shardtune.models.routing import routed_tokens, routers_recorded, with_router_loss
from shardtune.models.tiny import tiny_config_values
from shardtune.step import token_loss


def test_published_counts_and_active_parameters():
    """MISSION.md's counts (the built-in shapes equal the meta-device model: tests/unit/models/test_models.py); the
    names' "A3B" and Mixtral's 12.9B: the parameters one token's compute reads, the input embedding included."""
    qwen, mixtral = resolve_model("Qwen/Qwen3-30B-A3B"), resolve_model("mistralai/Mixtral-8x7B-v0.1")
    assert (qwen.params, mixtral.params) == (30_532_122_624, 46_702_792_704)
    assert (qwen.experts, qwen.experts_per_token, qwen.intermediate) == (128, 8, 768)
    assert (mixtral.experts, mixtral.experts_per_token, mixtral.intermediate) == (8, 2, 14336)
    assert 3.3e9 < qwen.non_embedding_matmul_params + qwen.embedding_params < 3.4e9
    assert 12.8e9 < mixtral.non_embedding_matmul_params + mixtral.embedding_params < 13.0e9


def test_flops_count_the_routed_experts_by_hand():
    shape = resolve_model("qwen3-30b-a3b")
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048  # q, k, v, o over 32 heads and 4 kv heads of 128
    routed = 8 * 3 * 2048 * 768 + 128 * 2048  # the top 8 of 128 experts' gated MLPs, and the router
    n = 48 * (attention + routed) + 151936 * 2048  # + lm_head
    assert shape.non_embedding_matmul_params == n
    assert flops_per_token(shape, 4096) == 6 * n + 12 * 32 * 128 * 48 * 4096
    # every expert's weights are held: the states follow all of them
    assert shape.layer_matmul_params == attention + 128 * 3 * 2048 * 768 + 128 * 2048


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_trained_loss_is_transformers_own(model_type):
    """On a padded micro-batch, with every layer recomputed: the trainer's loss (one micro-batch of one) is the
    model's own loss with output_router_logits, its load-balancing share the model's aux_loss, and the gradients
    are the same; the routers are recorded in the forward only (the recomputation runs them again)."""
    config = AutoConfig.for_model(model_type, **tiny_config_values(model_type, 40))
    torch.manual_seed(0)
    ids = torch.randint(3, 40, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    targets = (labels[:, 1:] != -100).sum()
    models, gradients = [], []
    for ours in (False, True):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config).train()
        enable_gradient_checkpointing(model, 1)
        if ours:
            with routers_recorded(model) as logits:
                loss = token_loss(model, model, batch, targets)
            loss, routing = with_router_loss(model, loss, logits, batch, micro_batches=1)
        else:
            output = model(**batch, output_router_logits=True)
            loss = output.loss
        loss.backward()
        models.append(loss.detach())
        gradients.append([parameter.grad for parameter in model.parameters()])
    assert len(logits) == config.num_hidden_layers
    torch.testing.assert_close(models[1], models[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(routing[0].float(), output.aux_loss.detach(), rtol=1e-6, atol=1e-7)
    assert float(output.aux_loss.detach()) > 1.0  # a real term: about top-k for a router near balance
    for theirs, ours in zip(*gradients, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    # each unpadded token once per layer and expert it is routed to
    assert routing[1:].sum() == int(mask.sum()) * config.num_experts_per_tok * config.num_hidden_layers


def test_routed_tokens_are_the_routers_top_k():
    config = types.SimpleNamespace(num_experts=4, num_experts_per_tok=1)
    model = types.SimpleNamespace(config=config)
    logits = [torch.tensor([[5.0, 0, 0, 0], [0, 0, 5.0, 0], [0, 0, 5.0, 0]])] * 2
    assert routed_tokens(model, logits, None).tolist() == [2, 0, 4, 0]
    assert routed_tokens(model, logits, torch.tensor([[1, 1, 0]])).tolist() == [2, 0, 2, 0]


def refusals(recipe: Recipe, model_type: str, **sizes) -> list[str]:
    text = types.SimpleNamespace(model_type=model_type, **tiny_config_values(model_type, 40))
    text.get_text_config = lambda: text
    try:
        check_family_levers(recipe, text, **{"sp_size": 1, "tp_size": 1, **sizes})
    except ConfigError as error:
        return error.messages
    return []


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_levers_refused_on_experts_each_in_one_line(model_type):
    recipe = Recipe(max_seq_length=64)
    assert refusals(recipe, model_type) == []
    for sizes, lever in (({"sp_size": 2}, "sequence_split"), ({"cp_size": 2}, "context_parallel"),
                         ({"tp_size": 2}, "tensor_parallel")):
        (message,) = refusals(recipe, model_type, **sizes)
        assert MOE_REFUSALS[lever] in message
    for recipe, lever in ((Recipe(max_seq_length=64, mixed_precision="fp8"), "fp8"),
                          (Recipe(max_seq_length=64, method="dpo"), "dpo"),
                          (Recipe(max_seq_length=64, use_peft=True), "peft"),
                          (Recipe(max_seq_length=64, torch_compile=True), "compile"),
                          (Recipe(max_seq_length=64, gradient_checkpointing=True,
                                  gradient_checkpointing_mode="selective"), "selective")):
        (message,) = refusals(recipe, model_type)
        assert MOE_REFUSALS[lever] in message and "\n" not in message and message.endswith(".")
    config = AutoConfig.for_model(model_type, **tiny_config_values(model_type, 40))
    with pytest.raises(ConfigError, match="drop --use_liger_kernel"):
        check_liger_model(Recipe(use_liger_kernel=True), config)


def test_dense_layers_among_experts_and_other_moe_refused():
    values = tiny_config_values("qwen3_moe", 40, mlp_only_layers=[0])
    with pytest.raises(ModelError, match="mixes dense layers") as caught:
        shape_from_config(AutoConfig.for_model("qwen3_moe", **values))
    assert "\n" not in str(caught.value)


def test_search_plans_no_layout_refused_on_experts():
    from shardtune.plan.search import Search, family_allows
    from shardtune.plan.states import Peft
    from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config

    def allowed(config: str, **search) -> bool:
        strategy = read_accelerate_config(os.path.join(CONFIGS_DIR, f"{config}.yaml"))
        return family_allows(strategy, Search(64, 32768, **search), resolve_model("mixtral-8x7b"))

    assert allowed("fsdp_full_shard") and allowed("ds_zero3")
    assert not allowed("ds_zero3_ulysses") and not allowed("fsdp_cp") and not allowed("fsdp_tp")
    assert not allowed("fsdp_full_shard", peft=Peft(16))


@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b", "mixtral_8x7b"])
def test_recipes_dry_run_prints_the_meta_device_count(recipe, tmp_path, monkeypatch):
    """Each MoE recipe's --dry_run (its header's launch) plans the model built on the meta device, and fits."""
    from shardtune.models.flops import BUILTIN_CONFIG_VALUES, builtin_name, recipe_fields
    from tests.unit.documented_commands import outside_a_launch, run

    outside_a_launch(monkeypatch)
    values = dict(BUILTIN_CONFIG_VALUES[builtin_name(recipe_fields(f"recipes/{recipe}.py")["model_name_or_path"])])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    code, printed = run([f"recipes/{recipe}.py", "--dry_run", "--hardware", "8xh100-80gb"], tmp_path)
    assert code == 0, printed
    assert f"({sum(parameter.numel() for parameter in model.parameters()):,} params)" in printed
    assert "-> fits" in printed


def test_models_page_quotes_the_counted_parameters():
    """docs/models.md's row of each mixture of experts gives the built-in shape's count."""
    from tests.conftest import REPO

    page = (REPO / "docs" / "models.md").read_text()
    for model_type, name in (("qwen3_moe", "qwen3-30b-a3b"), ("mixtral", "mixtral-8x7b")):
        row = next(line for line in page.splitlines() if line.startswith(f"| `{model_type}` |"))
        assert f"{name} ({resolve_model(name).params:,})" in row


def test_readme_rows_give_the_experts_counted():
    """The README's recipe rows: each mixture of experts' experts and experts per token, as the shape reads them."""
    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text()
    for recipe, name in (("qwen3_30b_a3b", "qwen3-30b-a3b"), ("mixtral_8x7b", "mixtral-8x7b")):
        row = next(line for line in readme.splitlines() if line.startswith(f"| `recipes/{recipe}.py` |"))
        shape = resolve_model(name)
        assert f"a mixture of experts ({shape.experts}, {shape.experts_per_token} per token)" in row


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory) -> tuple[str, str]:
    from shardtune.models.tiny_assets import write_tiny_assets

    root = tmp_path_factory.mktemp("moe") / "tiny"
    write_tiny_assets(str(root), num_examples=64, model_type="mixtral")
    return str(root / "model"), str(root / "data.jsonl")


@pytest.mark.parametrize("args,lever", [(("--use_liger_kernel", "true"), "liger"),
                                        (("--use_peft", "true"), "peft"),
                                        (("--gradient_checkpointing_mode", "selective"), "selective")])
def test_a_refused_lever_stops_the_recipe_in_one_line(args, lever, moe_assets, tmp_path, capsys, monkeypatch):
    """The recipe's own start-up: exit code 2, the refusal on a line of its own, nothing loaded or written
    (tests/unit/checks/test_bad_input.py; on this CPU Liger's missing GPU is a second line)."""
    from tests.unit.checks.test_bad_input import Case, refused

    lines, stderr = refused(Case(args, MOE_REFUSALS[lever]), moe_assets, tmp_path, capsys, monkeypatch)
    assert any(line.endswith(MOE_REFUSALS[lever]) for line in lines), stderr[-2000:]


def test_the_planner_refuses_them_in_one_line_too(tmp_path, monkeypatch):
    from tests.unit.documented_commands import outside_a_launch, run

    outside_a_launch(monkeypatch)
    for args, lever in ((("--use_peft", "true"), "peft"), (("--mixed_precision", "fp8"), "fp8"),
                        (("--config_file", "accelerate_configs/ds_zero3_ulysses.yaml"), "sequence_split")):
        code, printed = run(["-m", "shardtune.plan", "--model", "mixtral-8x7b", *args], tmp_path)
        assert code == 2 and "Traceback" not in printed, printed
        assert f"shardtune.plan: error: A mixtral model (a mixture of experts): {MOE_REFUSALS[lever]}" in printed

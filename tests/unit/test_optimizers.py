"""--optim: built as transformers' Trainer builds the same names, refused where it cannot run (one line each), and
its optimizer states planned to the byte that torchao allocates. torch.compile is replaced by the eager function
while these steps run: torchao compiles its per-tensor update on first use (tens of seconds on CPU), and the
states are allocated outside the compiled function, so their bytes are the same either way (the launched tests
run it compiled)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from shardtune.checks import check_choices, check_optimizer, validate
from shardtune.config import OPTIMIZERS, TORCHAO_OPTIMIZERS, ConfigError, Recipe
from shardtune.flops import resolve_model
from shardtune.hardware import parse_hardware
from shardtune.memory import held_model_states
from shardtune.optimizers import build_optimizer
from shardtune.plan.optimizer_states import parameter_matrices
from shardtune.plan.planner import plan
from shardtune.plan.states import model_states
from shardtune.plan.strategy import PlanError, Strategy
from tests.unit.test_async_io_check import deepspeed_launch

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (requirements.txt pins it)")

DDP = Strategy("ddp", "ddp", 0, mixed_precision="bf16")


def refusal(recipe: Recipe, on_gpu: bool, kind: str, world: int = 2) -> str:
    with pytest.raises(ConfigError) as error:
        check_optimizer(recipe, on_gpu, kind, world)
    (message,) = error.value.messages
    return message


@pytest.mark.parametrize("optim", OPTIMIZERS[1:])
def test_deepspeed_takes_adamw_torch_only(optim):
    assert "DeepSpeed" in refusal(Recipe(optim=optim, mixed_precision="bf16"), True, "deepspeed")
    check_optimizer(Recipe(optim="adamw_torch"), True, "deepspeed")  # accepted


def test_a_launch_under_deepspeed_is_refused_before_anything_loads(tmp_path):
    """validate(): the start-up checks, before the model or the data is read."""
    recipe = Recipe(model_name_or_path="m", dataset=str(tmp_path / "d.jsonl"), output_dir=str(tmp_path / "out"),
                    optim="adamw_torch_8bit", use_cpu=True, report_to="none")
    (tmp_path / "d.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as error:
        validate(recipe, deepspeed_launch("none", "none"), has_gpu=False)
    assert [message for message in error.value.messages if "--optim" in message] == [
        refusal(recipe, False, "deepspeed")]


def test_refusals_name_the_fix():
    assert "adamw_torch_8bit" in refusal(Recipe(optim="adamw_8bit"), False, "ddp")  # bitsandbytes on CPU
    assert "DTensor" in refusal(Recipe(optim="paged_adamw_8bit"), True, "fsdp")
    stochastic = "adamw_torch_bf16_stochastic_round"
    assert "--mixed_precision bf16" in refusal(Recipe(optim=stochastic, mixed_precision="no"), False, "fsdp")
    assert "LoRA" in refusal(Recipe(optim=stochastic, mixed_precision="bf16", use_peft=True), False, "fsdp")
    assert "FSDP" in refusal(Recipe(optim=stochastic, mixed_precision="bf16"), False, "ddp")
    # Accepted (the package looked for only where the run builds the optimizer): one process, torchao on CPU/FSDP2.
    check_optimizer(Recipe(optim=stochastic, mixed_precision="bf16"), False, "ddp", 1, False)
    check_optimizer(Recipe(optim="adamw_torch_8bit"), False, "fsdp", 2, False)
    with pytest.raises(ConfigError, match="--optim must be one of"):
        check_choices(Recipe(optim="adamw_torch_2bit"))


def test_a_missing_package_is_one_line_with_the_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert refusal(Recipe(optim="adamw_8bit"), True, "ddp").endswith("pip install bitsandbytes")
    assert refusal(Recipe(optim="adamw_torch_4bit"), False, "ddp").endswith("pip install torchao==0.18.0")


@needs_torchao
@pytest.mark.parametrize("optim", TORCHAO_OPTIMIZERS)
def test_built_as_transformers_trainer_builds_it(optim, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, learning_rate=3e-4, adam_beta1=0.8,
                             adam_beta2=0.9, adam_epsilon=1e-7, use_cpu=True, report_to="none")
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    recipe = Recipe(optim=optim, learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-7)
    built = build_optimizer(torch.nn.Linear(4, 4), recipe)
    assert type(built) is cls
    assert (built.block_size, built.bf16_stochastic_round) == (kwargs["block_size"], kwargs["bf16_stochastic_round"])
    group = built.param_groups[0]
    assert (group["betas"], group["eps"]) == (kwargs["betas"], kwargs["eps"])
    assert group["lr"].item() == pytest.approx(kwargs["lr"], rel=1e-7)  # torchao holds it as an fp32 tensor


def stepped_states(tiny_assets, optim: str, dtype: torch.dtype, monkeypatch) -> dict[str, int]:
    """Bytes held after one step of `optim` on the tiny model in `dtype` (one process: DDP's layout)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=dtype)
    optimizer = build_optimizer(model, Recipe(optim=optim, weight_decay=0.1))
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)  # eager: see the module's doc
    optimizer.step()
    return held_model_states(model, optimizer)


@needs_torchao
@pytest.mark.parametrize("optim", (*TORCHAO_OPTIMIZERS, "adamw_torch_bf16_stochastic_round"))
def test_planned_optimizer_states_are_the_bytes_torchao_holds(optim, tiny_assets, monkeypatch):
    stochastic = optim == "adamw_torch_bf16_stochastic_round"
    shape = resolve_model(tiny_assets[0])
    held = stepped_states(tiny_assets, optim, torch.bfloat16 if stochastic else torch.float32,
                          monkeypatch)
    planned = model_states(DDP, shape.params, 1, shape, optim)
    # Exact: every state tensor, scale, lookup table and step counter is counted.
    assert held["optimizer"] == planned.optimizer
    assert held["weights"] == planned.weights and held["gradients"] == planned.gradients
    # The tiny model has tensors on both sides of torchao's rule (>= 4096 elements in whole blocks): both counted.
    quantized = [rows * cols for rows, cols in parameter_matrices(shape) if rows * cols >= 4096]
    assert quantized and len(quantized) < len(parameter_matrices(shape))


def test_eight_bit_states_take_a_quarter_of_adams():
    """Llama-3.1-8B under FSDP2 on 8 GPUs: every local matrix is quantized; Adam's 8 bytes per parameter become 2
    and a scale per block of 256 (2 x 4 / 256 bytes), 1 and the scales in 4 bits."""
    shape = resolve_model("llama-3.1-8b")
    fsdp = Strategy("fsdp_full_shard", "fsdp", 3, mixed_precision="bf16")
    adam = model_states(fsdp, shape.params, 8, shape).optimizer
    eight = model_states(fsdp, shape.params, 8, shape, "adamw_torch_8bit").optimizer
    four = model_states(fsdp, shape.params, 8, shape, "adamw_torch_4bit").optimizer
    assert eight / adam == pytest.approx((2 + 8 / 256) / 8, rel=1e-3)
    assert four / adam == pytest.approx((1 + 8 / 256) / 8, rel=1e-3)
    stochastic = model_states(fsdp, shape.params, 8, shape, "adamw_torch_bf16_stochastic_round")
    assert (stochastic.weights, stochastic.gradients) == (2 * shape.params / 8, 2 * shape.params / 8)


def test_the_plan_carries_the_optimizer_and_refuses_it_under_deepspeed():
    shape = resolve_model("llama-3.1-8b")
    hardware = parse_hardware("8xh100-80gb")
    fsdp = Strategy("fsdp_full_shard", "fsdp", 3, mixed_precision="bf16")
    eight = plan(shape, hardware, fsdp, optim="adamw_torch_8bit")
    assert eight.to_json()["optim"] == "adamw_torch_8bit"
    assert eight.per_gpu["optimizer"] < plan(shape, hardware, fsdp).per_gpu["optimizer"] / 3
    with pytest.raises(PlanError, match="DeepSpeed"):
        plan(shape, hardware, dataclasses.replace(fsdp, kind="deepspeed"), optim="adamw_torch_8bit")


def bf16_losses(model_dir: str, optim: str, dtype: torch.dtype, steps: int = 30) -> list[float]:
    """Losses of `steps` updates on one fixed batch at lr 1e-5, the forward in bf16 (autocast: an fp32 model's
    matmuls run in bf16, as the trainer runs them)."""
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(3, 30, (8, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # the rounding's draws
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    optimizer = build_optimizer(model, Recipe(optim=optim, learning_rate=1e-5, mixed_precision="bf16"))
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@needs_torchao
def test_stochastic_rounding_tracks_the_fp32_master(tiny_assets, monkeypatch):
    """At lr 1e-5 most of Adam's updates are smaller than half of bf16's spacing at the weights' magnitudes: bf16
    weights rounded to nearest lose them (torch AdamW on a bf16 model: measured 19% of the fp32 master's loss drop
    over 30 steps), stochastic rounding keeps them on average (101%; losses within 9e-5 of the fp32 master's). The
    tolerance, 1e-3, is 10x that deviation and 8x below round-to-nearest's (8e-3)."""
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)  # eager: see the module's doc
    master = bf16_losses(tiny_assets[0], "adamw_torch", torch.float32)
    rounded = bf16_losses(tiny_assets[0], "adamw_torch_bf16_stochastic_round", torch.bfloat16)
    nearest = bf16_losses(tiny_assets[0], "adamw_torch", torch.bfloat16)
    assert rounded == pytest.approx(master, rel=1e-3)
    drop = master[0] - master[-1]
    assert rounded[0] - rounded[-1] == pytest.approx(drop, rel=0.1)
    assert nearest[0] - nearest[-1] < 0.5 * drop  # what the stochastic rounding saves

"""--optim and --bf16_stochastic_round: built as transformers' Trainer builds the same names, refused where they
cannot run (one line each), and their states planned to the byte that torchao allocates. torch.compile is replaced
by the eager function while these steps run: torchao compiles its per-tensor update on first use (tens of seconds
on CPU), and the states are allocated outside the compiled function, so their bytes are the same either way."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from shardtune.checks.startup import validate
from shardtune.checks.values import check_choices, check_optimizer
from shardtune.config import OPTIMIZERS, TORCHAO_OPTIMIZERS, BatchSizes, ConfigError, Recipe
from shardtune.levers.optimizers import build_optimizer
from shardtune.memory import held_model_states
from shardtune.models.flops import resolve_model
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.optimizer_states import parameter_matrices
from shardtune.plan.planner import plan
from shardtune.plan.states import model_states
from shardtune.plan.strategy import PlanError, Strategy
from shardtune.step import global_grad_norm
from tests.conftest import REPO
from tests.unit.checks.test_async_io_check import deepspeed_launch

DDP = Strategy("ddp", "ddp", 0, mixed_precision="bf16")
FSDP = Strategy("fsdp_full_shard", "fsdp", 3, mixed_precision="bf16")
STOCHASTIC_OPTIMIZERS = ("adamw_torch", *TORCHAO_OPTIMIZERS)


def refusal(recipe: Recipe, on_gpu: bool, kind: str, world: int = 2) -> str:
    with pytest.raises(ConfigError) as error:
        check_optimizer(recipe, on_gpu, kind, world)
    (message,) = error.value.messages
    assert "\n" not in message
    return message


def rounded(optim: str = "adamw_torch", **fields) -> Recipe:
    return Recipe(optim=optim, bf16_stochastic_round=True, mixed_precision="bf16", **fields)


@pytest.mark.parametrize("optim", OPTIMIZERS[1:])
def test_deepspeed_takes_adamw_torch_only(optim):
    assert "DeepSpeed" in refusal(Recipe(optim=optim), True, "deepspeed")
    assert "DeepSpeed" in refusal(rounded(), True, "deepspeed")  # no master copy to trade under ZeRO
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
    assert "--mixed_precision bf16" in refusal(dataclasses.replace(rounded(), mixed_precision="no"), False, "fsdp")
    assert "LoRA" in refusal(rounded(use_peft=True), False, "fsdp")
    assert "FSDP" in refusal(rounded(), False, "ddp")
    assert "adamw_torch_8bit" in refusal(rounded("adamw_8bit"), True, "ddp")
    # Accepted (the package looked for only where the run builds the optimizer): one process, torchao on CPU/FSDP2.
    for optim in STOCHASTIC_OPTIMIZERS:
        check_optimizer(rounded(optim), False, "ddp", 1, False)
        check_optimizer(rounded(optim), False, "fsdp", 2, False)
    with pytest.raises(ConfigError, match="--optim must be one of"):
        check_choices(Recipe(optim="adamw_torch_2bit"))


def test_a_missing_package_is_one_line_with_the_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert refusal(Recipe(optim="adamw_8bit"), True, "ddp").endswith("pip install bitsandbytes")
    assert refusal(Recipe(optim="adamw_torch_4bit"), False, "ddp").endswith("pip install torchao==0.18.0")
    assert refusal(rounded(), False, "fsdp").endswith("pip install torchao==0.18.0")


def test_help_labels_the_trade_of_the_master_copy():
    help_text = Recipe.__dataclass_fields__["bf16_stochastic_round"].metadata["help"]
    assert help_text.startswith("Trades the fp32 master copy")


@pytest.mark.parametrize("optim", TORCHAO_OPTIMIZERS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_built_as_transformers_trainer_builds_it(optim, stochastic, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, learning_rate=3e-4, adam_beta1=0.8,
                             adam_beta2=0.9, adam_epsilon=1e-7, use_cpu=True, report_to="none",
                             optim_args=f"bf16_stochastic_round={stochastic}")
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    recipe = Recipe(optim=optim, learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-7,
                    bf16_stochastic_round=stochastic)
    built = build_optimizer(torch.nn.Linear(4, 4), recipe)
    assert isinstance(built, cls)
    assert (built.block_size, built.bf16_stochastic_round) == (kwargs["block_size"], kwargs["bf16_stochastic_round"])
    group = built.param_groups[0]
    assert (group["betas"], group["eps"]) == (kwargs["betas"], kwargs["eps"])
    assert group["lr"].item() == pytest.approx(kwargs["lr"], rel=1e-7)  # torchao holds it as an fp32 tensor


def stepped_states(tiny_assets, recipe: Recipe, monkeypatch) -> dict[str, int]:
    """Bytes held after one step of the recipe's optimizer on the tiny model (one process: DDP's layout), loaded
    in the dtype the trainer loads it in."""
    from shardtune.model import load_model

    model = load_model(dataclasses.replace(recipe, model_name_or_path=tiny_assets[0], weight_decay=0.1))
    optimizer = build_optimizer(model, recipe)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)  # eager: see the module's doc
    optimizer.step()
    return model_state_bytes(model, optimizer)


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    held = held_model_states(model, optimizer)
    return {key: held[key] for key in ("weights", "gradients", "optimizer")}


@pytest.mark.parametrize("recipe", [Recipe(optim="adamw_torch_8bit"), Recipe(optim="adamw_torch_4bit"),
                                    rounded(), rounded("adamw_torch_8bit"), rounded("adamw_torch_4bit")],
                         ids=["8bit", "4bit", "adamw_torch+sr", "8bit+sr", "4bit+sr"])
def test_planned_states_are_the_bytes_torchao_holds(recipe, tiny_assets, monkeypatch):
    shape = resolve_model(tiny_assets[0])
    held = stepped_states(tiny_assets, recipe, monkeypatch)
    planned = model_states(DDP, shape.params, 1, shape, recipe.optim,
                           bf16_stochastic_round=recipe.bf16_stochastic_round)
    # Exact: every weight, gradient, state tensor, scale, lookup table and step counter is counted.
    assert held == {"weights": planned.weights, "gradients": planned.gradients, "optimizer": planned.optimizer}
    assert held["weights"] == (2 if recipe.bf16_stochastic_round else 4) * shape.params  # no fp32 master
    # The tiny model has tensors on both sides of torchao's rule (>= 4096 elements in whole blocks): both counted.
    quantized = [rows * cols for rows, cols in parameter_matrices(shape) if rows * cols >= 4096]
    assert quantized and len(quantized) < len(parameter_matrices(shape))


def test_low_bit_states_take_a_fraction_of_adams():
    """Llama-3.1-8B under FSDP2 on 8 GPUs: every local matrix is quantized; Adam's 8 bytes per parameter become 2
    and a scale per block of 256 (2 x 4 / 256 bytes), 1 and the scales in 4 bits. Stochastic rounding halves the
    weights and gradients and keeps no master."""
    shape = resolve_model("llama-3.1-8b")
    adam = model_states(FSDP, shape.params, 8, shape)
    eight = model_states(FSDP, shape.params, 8, shape, "adamw_torch_8bit")
    four = model_states(FSDP, shape.params, 8, shape, "adamw_torch_4bit")
    assert eight.optimizer / adam.optimizer == pytest.approx((2 + 8 / 256) / 8, rel=1e-3)
    assert four.optimizer / adam.optimizer == pytest.approx((1 + 8 / 256) / 8, rel=1e-3)
    lean = model_states(FSDP, shape.params, 8, shape, "adamw_torch_8bit", bf16_stochastic_round=True)
    assert (lean.weights, lean.gradients) == (2 * shape.params / 8, 2 * shape.params / 8)
    assert lean.optimizer == pytest.approx(eight.optimizer, rel=1e-3)  # the scales stay fp32
    assert (lean.weights + lean.gradients + lean.optimizer) / shape.params * 8 == pytest.approx(6.03, abs=0.01)


def test_the_plan_carries_the_optimizer_and_refuses_what_cannot_run():
    shape = resolve_model("llama-3.1-8b")
    hardware = parse_hardware("8xh100-80gb")
    eight = plan(shape, hardware, FSDP, optim="adamw_torch_8bit", bf16_stochastic_round=True)
    assert (eight.to_json()["optim"], eight.to_json()["bf16_stochastic_round"]) == ("adamw_torch_8bit", True)
    assert eight.per_gpu["optimizer"] < plan(shape, hardware, FSDP).per_gpu["optimizer"] / 3
    assert eight.per_gpu["weights"] == plan(shape, hardware, FSDP).per_gpu["weights"] / 2
    # The weights load in bf16 rather than fp32.
    assert eight.host_ram["model_loading"] == plan(shape, hardware, FSDP).host_ram["model_loading"] / 2
    with pytest.raises(PlanError, match="DeepSpeed"):
        plan(shape, hardware, dataclasses.replace(FSDP, kind="deepspeed"), optim="adamw_torch_8bit")
    with pytest.raises(PlanError, match="DeepSpeed"):
        plan(shape, hardware, dataclasses.replace(FSDP, kind="deepspeed"), bf16_stochastic_round=True)
    with pytest.raises(PlanError, match="bf16"):
        plan(shape, hardware, dataclasses.replace(FSDP, mixed_precision="no"), bf16_stochastic_round=True)


def bf16_losses(model_dir: str, recipe: Recipe, dtype: torch.dtype, steps: int = 30) -> list[float]:
    """Losses of `steps` updates on one fixed batch at lr 1e-5, the model's weights in `dtype` and the forward in
    bf16 (autocast: an fp32 model's matmuls run in bf16, as the trainer runs them)."""
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(3, 30, (8, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # the rounding's draws
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    optimizer = build_optimizer(model, dataclasses.replace(recipe, learning_rate=1e-5))
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


def test_stochastic_rounding_tracks_the_fp32_master(tiny_assets, monkeypatch):
    """At lr 1e-5 most of Adam's updates are smaller than half of bf16's spacing at the weights' magnitudes: bf16
    weights rounded to nearest lose them (torch AdamW on a bf16 model: measured 19% of the fp32 master's loss drop
    over 30 steps), stochastic rounding keeps them on average (101%; losses within 9e-5 of the fp32 master's). The
    tolerance, 1e-3, is 10x that deviation and 8x below round-to-nearest's (8e-3)."""
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)  # eager: see the module's doc
    master = bf16_losses(tiny_assets[0], Recipe(), torch.float32)
    stochastic = bf16_losses(tiny_assets[0], rounded(), torch.bfloat16)
    nearest = bf16_losses(tiny_assets[0], Recipe(), torch.bfloat16)  # torch AdamW on bf16 weights
    assert stochastic == pytest.approx(master, rel=1e-3)
    drop = master[0] - master[-1]
    assert stochastic[0] - stochastic[-1] == pytest.approx(drop, rel=0.1)
    assert nearest[0] - nearest[-1] < 0.5 * drop  # what the stochastic rounding saves
    assert nearest != pytest.approx(master, rel=1e-3)


def test_torchao_kernel_warnings_are_silenced_and_no_other(tmp_path):
    """Importing the package, then transformers' modeling (which imports torchao once installed): torchao's CUDA
    kernels cannot load into a CPU torch, and their 'Failed to load' lines are dropped, as are torch's deprecation
    warnings for torchao's enums registered as pytree constants; any other torchao or pytree warning still prints."""
    code = ("import shardtune, logging, enum, transformers.modeling_utils\n"
            "import sys; assert 'torchao' in sys.modules\n"
            "logging.getLogger('torchao').warning('another torchao warning')\n"
            "class Own(enum.Enum):\n    A = 1\n"
            "logging.getLogger('torch.utils._pytree').warning('%s is an Enum subclass', Own)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "Failed to load" not in output and "torchao/_C" not in output
    assert "another torchao warning" in output
    assert "KernelPreference" not in output and "ScaleCalculationMode" not in output
    assert "<enum 'Own'> is an Enum subclass" in output  # a registration of anyone else's still warns


def test_fsdp2_holds_the_bf16_weights_it_loaded(tiny_assets, monkeypatch):
    """One FSDP2 rank made as the trainer makes it (parallel.distributed.make_accelerator, load_model, accelerate's
    FSDP2 preparation): with --bf16_stochastic_round every sharded parameter stays bf16 (accelerate's preparation
    upcasts them to an fp32 master under any mixed precision but "no"), and after one step each rank holds the
    planned bytes of weights, gradients and 8-bit states."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import fsdp2_prepare_model
    from torch.distributed.tensor import DTensor

    from shardtune.launch import LaunchDescription
    from shardtune.model import load_model
    from shardtune.parallel.distributed import make_accelerator
    from tests.unit.test_fsdp_step import FSDP_ENV, free_port

    for name, value in {**FSDP_ENV, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    recipe = rounded("adamw_torch_8bit", model_name_or_path=tiny_assets[0], use_cpu=True, report_to="none",
                     weight_decay=0.1)
    try:
        accelerator = make_accelerator(recipe, BatchSizes(1, 1, 1), LaunchDescription.from_env(), None)
        model = fsdp2_prepare_model(accelerator, load_model(recipe))
        params = list(model.parameters())
        assert all(isinstance(param, DTensor) and param.dtype == torch.bfloat16 for param in params)
        optimizer = build_optimizer(model, recipe)
        torch.manual_seed(0)
        for param in params:
            local = torch.randn(param.to_local().shape, dtype=torch.bfloat16)
            param.grad = DTensor.from_local(local, param.device_mesh, param.placements)
        # The gradient norm is summed in fp32 and clips in place: within 1e-5, where bf16 would round it by 3e-3.
        exact = torch.cat([param.grad.full_tensor().double().reshape(-1) for param in params]).norm()
        assert exact > 10
        norm = global_grad_norm(accelerator, model, 1.0)
        assert norm.dtype == torch.float32 and float(norm) == pytest.approx(float(exact), rel=1e-5)
        clipped = torch.cat([param.grad.full_tensor().double().reshape(-1) for param in params]).norm()
        assert float(clipped) == pytest.approx(1.0, rel=1e-2)  # the clipped bf16 gradients
        for param in params:
            param.grad = torch.ones_like(param)
        monkeypatch.setattr(torch, "compile", lambda function, **options: function)
        optimizer.step()
        assert all(param.dtype == torch.bfloat16 for param in model.parameters())
        shape = resolve_model(tiny_assets[0])
        planned = model_states(FSDP, shape.params, 1, shape, "adamw_torch_8bit", bf16_stochastic_round=True)
        assert model_state_bytes(model, optimizer) == {
            "weights": planned.weights, "gradients": planned.gradients, "optimizer": planned.optimizer}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("recipe", [Recipe(optim="adamw_torch_8bit"), rounded("adamw_torch_4bit"), rounded()],
                         ids=["8bit", "4bit+sr", "adamw_torch+sr"])
def test_the_eager_step_transient_is_planned(recipe, monkeypatch):
    """torchao's step on one tensor, eager, in this process: the bytes it allocates above the states at its
    second step are optimizer_states.torchao_step_bytes of that tensor."""
    from shardtune.plan.optimizer_states import torchao_step_bytes
    from tests.unit.plan.test_memory_phases import step_rise

    monkeypatch.setattr(torch, "compile", lambda function, **options: function)  # eager: see the module's doc
    dtype = torch.bfloat16 if recipe.bf16_stochastic_round else torch.float32
    model = torch.nn.Linear(1024, 512, bias=False).to(dtype)
    optimizer = build_optimizer(model, dataclasses.replace(recipe, weight_decay=0.1))
    model.weight.grad = torch.randn_like(model.weight)
    rises = [step_rise(model, optimizer) for _ in range(2)]  # the second: the states exist already
    planned = torchao_step_bytes(recipe.optim, recipe.bf16_stochastic_round, model.weight.numel())
    assert rises[1] == pytest.approx(planned, rel=0.01)


@pytest.mark.parametrize("optim", TORCHAO_OPTIMIZERS)
def test_async_save_with_torchao_states_is_refused(optim):
    """torch.distributed.checkpoint's stager copies each state with new_empty, which torchao's quantized state
    tensors do not implement: the first background save would fail mid-run."""
    message = refusal(Recipe(optim=optim, async_save=True), True, "fsdp")
    assert "--async_save" in message and "new_empty" in message
    check_optimizer(Recipe(optim=optim), True, "fsdp", 2)  # synchronous saves copy them

"""--mixed_precision fp8 on CPU: which linears torchao's conversion swaps (shardtune.levers.float8), the refusals where
float8 cannot train, the --help text, and the planner's arithmetic for the float8 weights. The float8 training
itself on 2 ranks: tests/launch/test_float8.py; the float8 matmuls: scripts/gpu_check.py on a GPU. Compiled float8
layers trace whole and train as eager ones."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from shardtune.checks.startup import validate
from shardtune.config import ConfigError, Recipe
from shardtune.flags import recipe_parser
from shardtune.launch import LaunchDescription
from shardtune.levers.float8 import check_fp8, convert_linears
from shardtune.models.flops import resolve_model
from shardtune.models.tiny_assets import tiny_llama_config
from shardtune.plan.buffers import buffers, float8_weight_elements
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.planner import plan
from shardtune.plan.search import Search, recommend
from shardtune.plan.strategy import CONFIGS_DIR, PlanError, Strategy, read_accelerate_config

FP8 = Recipe(mixed_precision="fp8")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def tiny_model(device: str = "cpu", **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(tiny_llama_config(128, **overrides))


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the ranks that do not read the weights under FSDP2
def test_the_decoder_projections_convert_and_lm_head_does_not(device):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = tiny_model(device)
    names = convert_linears(model, all_gather=True)
    expected = [f"model.layers.{index}.{name}" for index in range(model.config.num_hidden_layers)
                for name in PROJECTIONS]
    assert names == expected
    converted = [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
    assert converted == expected and not isinstance(model.lm_head, Float8Linear)
    assert all(isinstance(model.get_submodule(name).weight, WeightWithDynamicFloat8CastTensor) for name in names)


def test_a_projection_not_a_multiple_of_16_stays_high_precision():
    model = tiny_model(intermediate_size=72)  # 72 = 4.5 x 16: gate, up and down cannot feed _scaled_mm
    names = convert_linears(model, all_gather=False)
    assert [name.split(".", 3)[-1] for name in names[:4]] == list(PROJECTIONS[:4])
    assert not [name for name in names if ".mlp." in name]


@pytest.mark.parametrize(("capability", "kind", "recipe", "message"), [
    (None, "fsdp", FP8, "runs float8 matmuls on CUDA GPUs of compute capability 8.9 or more"),
    ((8, 0), "fsdp", FP8, "this GPU's is 8.0: use --mixed_precision bf16"),
    ((9, 0), "deepspeed", FP8, "launch with an FSDP or DDP config, or use --mixed_precision bf16"),
    ((9, 0), "fsdp", dataclasses.replace(FP8, use_peft=True), "use --mixed_precision bf16 with --use_peft true"),
    ((9, 0), "fsdp-offload", FP8, "launch with fsdp_full_shard.yaml, or use --mixed_precision bf16 with the offload"),
], ids=["no GPU", "A100", "DeepSpeed", "LoRA", "FSDP CPU offload"])
def test_refused_where_float8_cannot_train(capability, kind, recipe, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_fp8(recipe, capability, kind.removesuffix("-offload"), kind.endswith("-offload"))
    assert len(error.value.messages) == 1


@pytest.mark.parametrize(("capability", "kind"), [((9, 0), "fsdp"), ((8, 9), "ddp"), ((10, 0), "fsdp")])
def test_runs_on_ada_hopper_and_later_under_fsdp_and_ddp(capability, kind):
    check_fp8(FP8, capability, kind)
    check_fp8(Recipe(), None, "deepspeed")  # bf16 needs none of it


def test_the_machine_check_collects_the_float8_refusal_with_the_others(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)
    recipe = dataclasses.replace(FP8, model_name_or_path="m", dataset="d", use_cpu=True,
                                 activation_offloading=True, pad_to_multiple_of=8)
    with pytest.raises(ConfigError) as error:
        validate(recipe, LaunchDescription.from_env(), has_gpu=False)
    assert any("--activation_offloading" in line for line in error.value.messages)
    assert any(line.startswith("--pad_to_multiple_of 8 under --mixed_precision fp8") for line in error.value.messages)
    assert any(line.startswith("--mixed_precision fp8 runs float8 matmuls") for line in error.value.messages)


def test_help_names_fp8_and_what_it_needs():
    text = " ".join(recipe_parser(Recipe()).format_help().split())
    assert "fp8: bf16 with the decoder layers' linears in float8" in text
    assert "compute capability 8.9 or more" in text


def test_the_planner_gathers_float8_weights_in_one_byte():
    shape = resolve_model("llama-3.1-8b")
    hardware = parse_hardware("8xh100-80gb")
    # q, o: 4096 x 4096; k, v: 4096 x 1024; gate, up, down: 4096 x 14336: all multiples of 16.
    assert float8_weight_elements(shape) == shape.layer_matmul_params == 218_103_808
    fsdp = Strategy("fsdp_full_shard", "fsdp", 3)
    fp8 = dataclasses.replace(fsdp, mixed_precision="fp8")
    # One layer computing and one prefetched, each float8 weight 1 byte instead of 2.
    assert buffers(fsdp, shape, shape.params, 8, "half") - buffers(fp8, shape, shape.params, 8, "half") \
        == 2 * float8_weight_elements(shape)
    grad_op = dataclasses.replace(fsdp, shard=2)  # every layer stays gathered from forward to backward
    assert buffers(grad_op, shape, shape.params, 8, "half") \
        - buffers(dataclasses.replace(grad_op, mixed_precision="fp8"), shape, shape.params, 8, "half") \
        == shape.layers * float8_weight_elements(shape)
    ddp = Strategy("ddp", "ddp", 0)
    # Autocast's cached bf16 copies: lm_head's alone, as a float8 linear casts its own weight.
    assert buffers(dataclasses.replace(ddp, mixed_precision="fp8"), shape, shape.params, 1, "autocast") \
        == 2 * shape.embedding_params
    bf16_plan, fp8_plan = plan(shape, hardware, fsdp), plan(shape, hardware, fp8)
    assert fp8_plan.to_json()["mixed_precision"] == "fp8"
    assert bf16_plan.per_gpu["buffers"] - fp8_plan.per_gpu["buffers"] == 2 * float8_weight_elements(shape)
    assert fp8_plan.per_gpu["activations"] == bf16_plan.per_gpu["activations"]  # the bf16 inputs are saved
    for refused in (dataclasses.replace(fp8, kind="deepspeed"), dataclasses.replace(fp8, offload_params="cpu")):
        with pytest.raises(PlanError, match="fp8 trains full fine-tuning under FSDP2 without offload or DDP"):
            plan(shape, hardware, refused)


def test_the_compare_table_under_fp8_leaves_out_and_names_the_configs_fp8_refuses(capsys):
    from shardtune.plan.__main__ import main as plan_main

    assert plan_main(["--model", "llama-3.1-8b", "--mixed_precision", "fp8", "--compare"]) == 0
    output = capsys.readouterr().out
    rows = [line.split()[0] for line in output.splitlines() if line.startswith(("ddp", "fsdp", "ds_"))]
    assert rows == ["ddp", "fsdp_shard_grad_op", "fsdp_full_shard"]
    assert ("Not planned: ds_zero1, ds_zero2, ds_zero3, ds_zero3_ulysses, fsdp_cp, ds_zero3_offload_optimizer, "
            "ds_zero3_offload_optimizer_ulysses, ds_zero3_cpu_offload, fsdp_full_shard_cpu_offload, "
            "ds_zero3_nvme_offload (--mixed_precision fp8 trains under FSDP2 without offload or context "
            "parallelism, or DDP).") in output


def test_odd_dimensions_are_not_counted_as_float8():
    shape = dataclasses.replace(resolve_model("llama-3.1-8b"), intermediate=14344)  # not a multiple of 16
    assert float8_weight_elements(shape) == 2 * 4096 * 4096 + 2 * 4096 * 1024


def test_recommend_keeps_the_precision_it_is_given():
    shape, hardware = resolve_model("llama-3.1-8b"), parse_hardware("8xh100-80gb")
    assert recommend(shape, hardware).plan.mixed_precision == "bf16"  # never traded for fp8
    chosen = recommend(shape, hardware, Search(mixed_precision="fp8")).plan
    assert chosen.mixed_precision == "fp8" and not chosen.config.startswith("ds_")
    # 70B fits one node only with FSDP's CPU offload in fp8 (no stochastic rounding: it needs bf16), which fp8 refuses.
    seventy = resolve_model("llama-3.1-70b")
    offloaded = read_accelerate_config(os.path.join(CONFIGS_DIR, "fsdp_full_shard_cpu_offload.yaml"), "bf16")
    assert plan(seventy, hardware, offloaded, 1, 4096, True).gpu_fits
    assert recommend(seventy, hardware, Search(mixed_precision="fp8")).plan is None


def test_gpu_check_runs_fp8_on_float8_tensor_cores_and_against_its_bf16_run():
    from shardtune.flags import parse_recipe
    from tests.conftest import load_script

    gpu_check = load_script("gpu_check")
    config, accumulation, packing, levers = next(case for case in gpu_check.CASES if case[3] == gpu_check.FP8)
    assert (config, accumulation, packing, {}) in gpu_check.CASES  # its bf16 reference
    assert parse_recipe(Recipe(), ["--mixed_precision", levers["mixed_precision"]]).mixed_precision == "fp8"
    assert [gpu_check.runs_here(levers, capability) for capability in ((8, 0), (8, 6), (8, 9), (9, 0))] \
        == [False, False, True, True]
    assert gpu_check.runs_here({}, (7, 0))
    name = gpu_check.case_name(config, accumulation, packing, levers)
    reference = gpu_check.case_name(config, accumulation, packing, {})
    assert name == f"{reference} fp8"
    from shardtune.gpu_check.figures import MEASURED_PHASES, comparison

    measured = {f"{phase}_error": 0.0 for phase, _ in MEASURED_PHASES} | {  # the reserves within their plan
        "fragmentation_gb": 1.0, "fragmentation_planned_gb": 8.0, "outside_allocator_gb": 1.0,
        "outside_allocator_planned_gb": 2.0}
    plain = {"case": reference, "first_grad_norm": 2.0, "losses": [11.0, 10.0], **measured}
    close = {"case": name, "first_grad_norm": 2.02, "losses": [11.1, 10.05], **measured}
    found = comparison(close, plain)  # (the hidden states: tests/unit/gpu_check/test_gpu_check_compare.py)
    assert found["gaps"] == {"grad_norm": pytest.approx(0.01), "loss": pytest.approx(0.1 / 11.0)}
    assert found["failed"] == ["hidden"]  # not probed: the comparison fails
    assert gpu_check.failed_cases([plain, close], [found]) == [name]
    far = {**close, "losses": [11.0, 10.5]}
    assert comparison(far, plain)["failed"] == ["hidden", "loss"]  # the losses beyond the fp8 tolerance, 2%


def test_the_float8_lever_needs_cuda_float8_tensor_cores_and_no_deepspeed():
    from shardtune.levers.catalogue import LEVERS

    (lever,) = [lever for lever in LEVERS if lever.flags == ("--mixed_precision", "fp8")]
    assert not lever.always  # it trades precision
    assert lever.runs("fsdp", 3, 8, "bf16", False, cuda=False) == "needs CUDA"
    assert lever.runs("fsdp", 3, 8, "bf16", False, cuda=True, capability=(8, 0)) == "needs compute capability 8.9"
    assert lever.runs("deepspeed", 3, 8, "bf16", False, cuda=True, capability=(9, 0)) == "not under DeepSpeed"
    assert lever.runs("fsdp", 3, 8, "bf16", False, cuda=True, capability=(9, 0)) == ""
    assert lever.runs("ddp", 0, 8, "no", False, cuda=True, capability=(8, 9)) == ""


def test_planner_md_states_the_float8_figures_the_planner_computes():
    from tests.conftest import REPO

    text = " ".join((REPO / "docs" / "planner.md").read_text().split())
    shape, hardware = resolve_model("llama-3.1-8b"), parse_hardware("8xh100-80gb")
    fsdp = Strategy("fsdp_full_shard", "fsdp", 3)
    saved = plan(shape, hardware, fsdp).per_gpu["buffers"] \
        - plan(shape, hardware, dataclasses.replace(fsdp, mixed_precision="fp8")).per_gpu["buffers"]
    ddp = Strategy("ddp", "ddp", 0)
    cached = [buffers(dataclasses.replace(ddp, mixed_precision=precision), shape, shape.params, 1, "autocast")
              for precision in ("fp8", "bf16")]
    assert f"Llama-3.1-8B's {float8_weight_elements(shape):,} elements per layer make {saved / 1e9:.2f} GB less" in text
    assert f"only lm_head's stays ({cached[0] / 1e9:.2f} GB instead of {cached[1] / 1e9:.1f} GB" in text


def test_training_md_states_what_the_launched_float8_test_asserts():
    from tests.conftest import REPO
    from tests.launch.test_float8 import FLOAT8_LINEARS, LOSS_RTOL

    text = " ".join((REPO / "docs" / "training.md").read_text().split())
    assert f"every rank's {FLOAT8_LINEARS} linears gather in float8" in text
    assert f"the losses stay within {LOSS_RTOL:.0%} of the bf16 run's" in text
    assert f"the losses stay within {LOSS_RTOL:.0%} of the FULL_SHARD fp8 run's" in text
    assert "the fp8 run repeats steps 4 to 6 exactly" in text
    assert len(PROJECTIONS) * tiny_llama_config(128).num_hidden_layers == FLOAT8_LINEARS


def test_selective_checkpointing_meets_a_float8_matmul_as_mm():
    """shardtune.model's policy saves by aten op: a float8 linear's product reaches it as aten.mm (torchao's float8
    tensors turn it into _scaled_mm below the policy), so selective checkpointing keeps the same outputs."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from shardtune.model import SAVED_MATMUL

    seen = []

    def policy(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(func)
        return CheckpointPolicy.PREFER_RECOMPUTE

    layers = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    convert_linears(layers, all_gather=False, emulate=True)
    inputs = torch.randn(4, 32, requires_grad=True)
    checkpoint(layers, inputs, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(policy)).sum().backward()
    assert seen.count(SAVED_MATMUL) == 2  # one per linear
    assert not [func for func in seen if "_scaled_mm" in str(func)]


def float8_training(compiled: bool) -> list[tuple[float, float]]:
    """Three AdamW steps of a 2-layer fp32 tiny Llama whose decoder linears train in emulated float8 (the casts and
    scales of a GPU, the products in fp32), its layers compiled by --torch_compile's regional compilation or not:
    (loss, gradient norm) of each step."""
    from shardtune.levers.compile import compile_decoder_layers
    from shardtune.levers.tiled_loss import chunked_token_loss

    torch.manual_seed(0)
    model = tiny_model()
    model.config.use_cache = False
    convert_linears(model, all_gather=False, emulate=True)
    if compiled:
        compile_decoder_layers(model, Recipe(torch_compile=True, torch_compile_backend="aot_eager"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    figures = []
    for length in (32, 48, 40):  # a second length makes the graph dynamic; the third reuses it
        ids = torch.randint(3, model.config.vocab_size, (2, length), generator=data)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        loss = chunked_token_loss(model, model, batch, torch.tensor(2 * (length - 1)))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        figures.append((loss.item(), norm.item()))
    return figures


def test_compiled_float8_layers_train_as_eager_float8_without_graph_breaks():
    """--mixed_precision fp8 with --torch_compile (torchtitan's and torchao's pairing: inductor fuses the amax and
    the casts to float8): dynamo and AOTAutograd trace each layer whole, torchao's float8 tensors inside the graph,
    and it trains as the eager float8 layers do. The aot_eager backend runs the traced graph without generating
    kernels: inductor's CPU kernels would take a minute here and are not the Triton ones a GPU runs
    (scripts/gpu_check.py runs those)."""
    from torch._dynamo.utils import counters

    from shardtune.levers.compile import local_compile_figures

    torch.set_num_threads(1)
    eager = float8_training(compiled=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = float8_training(compiled=True)
    # The traced graph runs the same ops in the same order (inductor, measured: equal too on this model).
    assert compiled == eager
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert local_compile_figures()["compiled_frames"] == 2  # static at 32, dynamic at 48, reused at 40


def test_the_machine_check_passes_fsdp_s_cpu_offload_to_the_float8_check(monkeypatch):
    from shardtune.checks import startup as checks

    monkeypatch.setattr(checks, "gpu_capability", lambda recipe, on_gpu: (9, 0))  # an H100, as far as fp8 asks
    recipe = dataclasses.replace(FP8, model_name_or_path="m", dataset="d")
    offloaded = LaunchDescription(world_size=2, local_world_size=2, uses_fsdp=True, fsdp_offload_params=True)
    with pytest.raises(ConfigError) as error:
        validate(recipe, offloaded, has_gpu=True)
    assert any(line.startswith("--mixed_precision fp8 casts each weight shard") for line in error.value.messages)
    validate(recipe, dataclasses.replace(offloaded, fsdp_offload_params=False), has_gpu=True)  # fsdp_full_shard

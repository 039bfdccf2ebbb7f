"""The memory planner: exact parameter counts, model-state formulas, the 70B verdict, the CLI, and the activation
formula calibrated against what autograd really saves on tiny Llamas."""

from __future__ import annotations

import os
import re
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

from shardtune.config import Recipe
from shardtune.flags import parse_recipe
from shardtune.model import enable_gradient_checkpointing
from shardtune.models.flops import BUILTIN_MODELS, builtin_configs, resolve_model, shape_from_config
from shardtune.models.flops import main as flops_main
from shardtune.models.tiny_assets import tiny_llama_config
from shardtune.plan.__main__ import main
from shardtune.plan.activations import activation_bytes, layer_activation_bytes, saved_activation_bytes
from shardtune.plan.hardware import HardwareError, nominal_gpu_memory, parse_hardware
from shardtune.plan.planner import plan, usable_capacity
from shardtune.plan.search import Search, candidates, launch_command, recommend
from shardtune.plan.states import Peft
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config
from tests.conftest import REPO

MISSION_PARAMS = {
    "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800, "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360, "gemma-3-12b": 11_766_034_176,
    "olmo-2-7b": 7_298_617_344, "qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704,
    # Not in MISSION.md: the meta-device counts of their config.json (model cards: 32.8B, 3B, 8B).
    "qwen3-32b": 32_762_123_264, "smollm3-3b": 3_075_098_624, "granite-3.3-8b": 8_170_864_640,
}
H100 = parse_hardware("8xh100-80gb")


def config(name: str):
    return read_accelerate_config(os.path.join(CONFIGS_DIR, f"{name}.yaml"))


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_exact_parameter_counts(name):
    assert resolve_model(name).params == MISSION_PARAMS[name]


@pytest.mark.parametrize("name,cls", [("llama-3.2-1b", LlamaForCausalLM), ("mistral-7b", MistralForCausalLM),
                                      ("qwen2.5-7b", Qwen2ForCausalLM)])
def test_analytic_count_matches_meta_model(name, cls):
    """The analytic count equals numel over a model built on the meta device (tied weights once)."""
    with torch.device("meta"):
        model = cls(builtin_configs()[name])
    unique = {id(p): p.numel() for p in model.parameters()}
    assert sum(unique.values()) == resolve_model(name).params


def test_hub_ids_and_recipes_resolve_to_builtins():
    assert resolve_model("meta-llama/Llama-3.1-70B").name == "llama-3.1-70b"
    assert resolve_model("mistralai/Mistral-7B-v0.1").name == "mistral-7b"
    assert resolve_model(str(REPO / "recipes" / "qwen2_5_7b.py")).params == MISSION_PARAMS["qwen2.5-7b"]


def test_70b_zero3_does_not_fit_8xh100():
    result = plan(resolve_model("llama-3.1-70b"), H100, config("ds_zero3"), 1, 4096, True)
    states = result.per_gpu["weights"] + result.per_gpu["gradients"] + result.per_gpu["optimizer"]
    # 18 bytes per parameter / 8 (16-bit weights, fp32 accumulated gradients, fp32 master, m, v) and one optimizer
    # sub-group's fp32 gradient: the largest is the embedding's partition, 128256 x 8192 / 8 elements.
    assert states == pytest.approx(18 * MISSION_PARAMS["llama-3.1-70b"] / 8 + 4 * 128256 * 8192 / 8)
    assert not result.fits
    fsdp = plan(resolve_model("llama-3.1-70b"), H100, config("fsdp_full_shard"), 1, 4096, True)
    assert fsdp.per_gpu["weights"] + fsdp.per_gpu["gradients"] + fsdp.per_gpu["optimizer"] >= 141e9


def test_planning_70b_is_fast():
    start = time.perf_counter()
    recommend(resolve_model("llama-3.1-70b"), H100, Search(64, 4096))
    assert time.perf_counter() - start < 5


def test_ddp_1b_fits_80gb():
    result = plan(resolve_model("llama-3.2-1b"), H100, config("ddp"), 1, 4096, True)
    assert result.fits
    assert result.per_gpu["weights"] + result.per_gpu["gradients"] + result.per_gpu["optimizer"] == pytest.approx(
        16 * MISSION_PARAMS["llama-3.2-1b"])


@pytest.mark.parametrize("name,per_param", [
    # bf16 ZeRO-2 accumulates into the fp32 partition the optimizer reads; ZeRO-3 into an fp32 partition beside
    # the optimizer's, plus one sub-group's fp32 gradient at the step: 8B's largest is 105,512,960 elements of
    # zero3.json's sub_group_size 1e8 (measured: test_reduce_precision in bf16, test_memory_measured in fp32
    # and, with several sub-groups, in bf16 on 3 ranks)
    ("ds_zero1", 4 + 12 / 8), ("ds_zero2", 2 + 16 / 8),
    ("ds_zero3", 18 / 8 + 4 * 105_512_960 / MISSION_PARAMS["llama-3.1-8b"]), ("fsdp_full_shard", 16 / 8),
    ("fsdp_shard_grad_op", 16 / 8),
])
def test_model_states_follow_the_zero_table(name, per_param):
    result = plan(resolve_model("llama-3.1-8b"), H100, config(name), 1, 1024, True)
    states = result.per_gpu["weights"] + result.per_gpu["gradients"] + result.per_gpu["optimizer"]
    assert states == pytest.approx(per_param * MISSION_PARAMS["llama-3.1-8b"])


def test_fp32_deepspeed_keeps_an_fp32_master_clone():
    strategy = read_accelerate_config(os.path.join(CONFIGS_DIR, "ds_zero1.yaml"), mixed_precision="no")
    result = plan(resolve_model("llama-3.1-8b"), H100, strategy, 1, 1024, True)
    states = result.per_gpu["weights"] + result.per_gpu["gradients"] + result.per_gpu["optimizer"]
    assert states == pytest.approx((8 + 12 / 8) * MISSION_PARAMS["llama-3.1-8b"])


def test_70b_recommendation_trades_precision_before_it_offloads():
    """No GPU-only plan with torch's AdamW fits 70B on one node; the search steps down the optimizer ladder before
    it offloads, and 8-bit states without an fp32 master fit (with the master they do not). Held to torch's
    AdamW, the optimizer states go to host RAM."""
    found = recommend(resolve_model("llama-3.1-70b"), H100, Search(64, 4096))
    assert found.gpu_only and (found.plan.config, found.plan.optim, found.plan.bf16_stochastic_round) == (
        "fsdp_full_shard", "adamw_torch_8bit", True)
    assert "optimizer adamw_torch_8bit with bf16 stochastic rounding (no fp32 master)" in found.message
    # The exact alternative is named: torch's AdamW with its states in host RAM.
    assert "the fastest that fits with it: ds_zero3_offload_optimizer" in found.message
    command = launch_command(found.plan, "recipes/llama70b_no_offload.py")
    assert command.endswith("--gradient_checkpointing_mode full --optim adamw_torch_8bit --bf16_stochastic_round "
                            "true")
    recipe = parse_recipe(Recipe(), command.split("recipes/llama70b_no_offload.py ")[1].split())
    assert (recipe.optim, recipe.bf16_stochastic_round, recipe.per_device_train_batch_size) == (
        "adamw_torch_8bit", True, 1)
    master = recommend(resolve_model("llama-3.1-70b"), H100,
                       Search(64, 4096, optim="adamw_torch_8bit", bf16_stochastic_round=False))
    assert not master.gpu_only
    found = recommend(resolve_model("llama-3.1-70b"), H100, Search(64, 4096, optim="adamw_torch"))
    assert found.plan is not None and not found.gpu_only
    assert "offload" in found.plan.config and "nvme" not in found.plan.config
    assert found.plan.host_ram_per_node <= found.plan.host_ram_capacity == 0.9 * 2e12  # 2 TB per 8-GPU node
    assert "No GPU-only config fits: the smallest" in found.message and "host RAM per node" in found.message
    assert found.plan.micro_batch * found.accumulation * 8 == 64


def test_capacity_keeps_headroom_and_a_launch_reads_gpus_by_the_cli_rule():
    assert usable_capacity(H100) == int(80e9 * 0.9 - 2 * 2**30)
    assert nominal_gpu_memory(int(79.6 * 2**30)) == 80e9  # a card's label in GiB, planned as the CLI reads it
    found = recommend(resolve_model("llama-3.1-8b"), H100, Search(64, 4096))
    assert found.plan.per_gpu["total"] <= usable_capacity(H100) < 0.9 * 80e9


def test_host_ram_binds_and_the_smallest_node_count_is_named():
    """405B: micro-batch 1 fits the GPUs of one node only with NVMe offload, whose host-side gradient
    partitions exceed 2 TB: the message says host RAM binds, and names the node count that fits."""
    found = recommend(resolve_model("llama-3.1-405b"), H100, Search(128, 4096))
    assert found.plan is None
    assert "binding limit is host RAM" in found.message and "--host_ram_gb" in found.message
    nodes = int(re.search(r"It fits on (\d+) such nodes", found.message).group(1))
    assert 128 % (8 * nodes) == 0
    assert recommend(resolve_model("llama-3.1-405b"), H100.with_nodes(nodes), Search(128, 4096)).plan is not None
    assert recommend(resolve_model("llama-3.1-405b"), H100.with_nodes(nodes // 2), Search(128, 4096)).plan is None


def test_nothing_fits_skips_node_counts_the_global_batch_does_not_divide(tmp_path):
    """70B full fine-tuning without offload: 3 nodes (24 GPUs) cannot keep a global batch of 64, so the
    smallest count named is one that can; the binding limit on one node is GPU memory."""
    shutil.copy(os.path.join(CONFIGS_DIR, "fsdp_full_shard.yaml"), tmp_path)
    exact = Search(64, 4096, configs_dir=str(tmp_path), optim="adamw_torch", bf16_stochastic_round=False)
    found = recommend(resolve_model("llama-3.1-70b"), H100, exact)
    assert found.plan is None and "binding limit is GPU memory" in found.message
    nodes = int(re.search(r"It fits on (\d+) such nodes", found.message).group(1))
    assert nodes >= 2 and 64 % (8 * nodes) == 0
    for fewer in range(1, nodes):
        if 64 % (8 * fewer) == 0:
            assert recommend(resolve_model("llama-3.1-70b"), H100.with_nodes(fewer), exact).plan is None


def test_qlora_loads_its_base_in_4_bits_not_fp32():
    shape = resolve_model("llama-3.1-70b")
    qlora = plan(shape, H100, config("ddp"), 1, 4096, True, peft=Peft(16, load_in_4bit=True))
    assert qlora.host_ram["model_loading"] == pytest.approx(8 * (0.516 * shape.params + 5e9), rel=1e-3)
    lora = plan(shape, H100, config("fsdp_full_shard"), 1, 4096, True, peft=Peft(16))
    assert lora.host_ram["model_loading"] == 2 * shape.params  # bf16 base, read by rank 0 alone


def test_small_model_recommendation_is_ddp_and_keeps_global_batch():
    found = recommend(resolve_model("llama-3.2-1b"), H100, Search(64, 4096))
    assert found.gpu_only and found.plan.config == "ddp"
    assert found.plan.micro_batch * found.accumulation * 8 == 64


def test_too_small_host_ram_names_the_way_out():
    found = recommend(resolve_model("llama-3.1-405b"), parse_hardware("8x80gb", host_ram_gb=512), Search(64, 4096))
    assert found.plan is None
    assert "Nothing fits" in found.message and "LoRA" in found.message
    assert "460.8 GB is usable" in found.message  # 512 GB less 10%


def test_hardware_forms():
    assert parse_hardware("2x8xh100-80gb").world_size == 16
    assert parse_hardware("4x40gb").gpu_memory == 40e9
    with pytest.raises(HardwareError, match="8xh100-80gb"):
        parse_hardware("eight-h100s")
    assert parse_hardware("8xh100-pcie-80gb").gpu == "h100-pcie"
    with pytest.raises(HardwareError, match="Unknown GPU 'h10' .* known GPUs are a100, b200, h100, h100-pcie, h200"):
        parse_hardware("8xh10-80gb")  # a typo is not a GPU of its own


def test_cli_refuses_impossible_values_all_at_once(capsys):
    code = main(["--model", "llama-3.1-8b", "--per_device_train_batch_size", "0", "--max_seq_length", "-5",
                 "--lora_r", "8", "--host_ram_gb", "0"])
    errors = capsys.readouterr().err.splitlines()
    assert code == 2 and len(errors) == 4, errors
    assert "--per_device_train_batch_size must be >= 1, got 0" in errors[0]
    assert "--max_seq_length must be >= 2, got -5" in errors[1]
    assert "--host_ram_gb" in errors[2] and "add --use_peft true" in errors[3]
    assert main(["--model", "llama-3.1-8b", "--use_peft", "true", "--lora_target_modules", "qkv"]) == 2
    assert "are not linear layers of llama-3.1-8b" in capsys.readouterr().err
    assert flops_main(["--model", "llama-3.1-8b", "--tokens_per_second", "1000", "--gpus", "0"]) == 2
    assert capsys.readouterr().err.strip() == "shardtune.models.flops: error: --gpus must be > 0, got 0."


@pytest.mark.parametrize("mode", ["fp32", "half"])
def test_a_packed_row_saves_what_one_masked_row_of_its_tokens_saves(mode):
    """SDPA on a packed row: transformers builds a block-diagonal mask over the one row of batch x seq tokens (a
    dense mask, as a padded batch's), which the planner plans for packing under SDPA and eager."""
    torch.set_num_threads(1)
    cfg = tiny_llama_config(96, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    measured, _ = measure_saved(cfg, 4, 24, mode, False, False, packed=True)
    estimate = saved_activation_bytes(shape_from_config(cfg), 1, 4 * 24, mode, False, "sdpa", masked=True)
    assert estimate == pytest.approx(measured, rel=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_frozen_base_saves_no_inputs_for_weight_gradients(checkpointing):
    """LoRA on a frozen base: the norms keep no normalised input, lm_head no input and the embedding no ids (no
    weight gradient needs them). Not counted: the adapters' rank-r intermediates (lora_B's inputs, 7 x r per
    token and layer), 2% of this 96-wide model's layer and far less at rank 16 on a 4096-wide one; the planned
    bytes are within 3% without recomputation, and exact with it (where only layer inputs are saved)."""
    torch.set_num_threads(1)
    cfg = tiny_llama_config(96)
    cfg._attn_implementation = "sdpa"
    measured, _ = measure_saved(cfg, 2, 32, "fp32", checkpointing, True, lora=True)
    shape = shape_from_config(cfg)
    frozen = saved_activation_bytes(shape, 2, 32, "fp32", checkpointing, "sdpa", frozen=True)
    assert frozen == pytest.approx(measured, rel=1e-4 if checkpointing else 0.03)
    assert saved_activation_bytes(shape, 2, 32, "fp32", checkpointing, "sdpa") > measured


def test_the_planner_takes_every_attention_implementation_the_recipe_does():
    from shardtune.config import ATTENTION_PACKAGES, PLANNED_ATTENTION

    assert PLANNED_ATTENTION.keys() == ATTENTION_PACKAGES.keys()
    shape, hardware = resolve_model("llama-3.1-8b"), parse_hardware("8xh100-80gb")
    strategy = read_accelerate_config(str(REPO / "accelerate_configs" / "fsdp_full_shard.yaml"), "bf16")
    sdpa, flash = (plan(shape, hardware, strategy, 4, 4096, False, PLANNED_ATTENTION[name], packing=True)
                   for name in ("sdpa", "flash_attention_2"))
    # One row of 4 x 4096 tokens: SDPA's block-diagonal mask is 2 bytes x 16,384^2 per layer, flash has none.
    mask = shape.layers * 2 * (4 * 4096) ** 2
    assert sdpa.per_gpu["activations"] - flash.per_gpu["activations"] > mask


def test_compare_chart_is_a_png(tmp_path, capsys):
    chart = tmp_path / "plan.png"
    assert main(["--model", "llama-3.1-70b", "--compare", "--chart", str(chart)]) == 0
    assert "ds_zero3_cpu_offload" in capsys.readouterr().out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 5000


# ---------------------------------------------------------------------------------------------------------------
# Activation calibration: count unique storages saved for backward in one forward of a tiny Llama.


def _is_weight_copy(tensor: torch.Tensor, params: set[int]) -> bool:
    """A 16-bit copy of a parameter made by autocast (ToCopy of an AccumulateGrad leaf): a buffer, not an
    activation. Returned separately so the activation count stays clean."""
    grad_fn = tensor.grad_fn
    while grad_fn is not None and grad_fn.name() in ("TBackward0", "ViewBackward0", "PermuteBackward0"):
        grad_fn = grad_fn.next_functions[0][0]  # linear saves the copy transposed
    if grad_fn is None or grad_fn.name() != "ToCopyBackward0":
        return False
    source = grad_fn.next_functions[0][0]
    return source is not None and hasattr(source, "variable") and id(source.variable) in params


def measure_saved(cfg, batch: int, seq: int, mode: str, checkpointing: bool, padded: bool, packed: bool = False,
                  lora: bool = False) -> tuple[int, int]:
    """(activation bytes, autocast weight-copy bytes) saved for backward by one forward with labels: `batch` rows
    of `seq` tokens, or with `packed` one row of them all (position ids restarting per sequence); with `lora`
    rank-4 adapters on every linear layer of a frozen base, as shardtune.model builds them."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    if mode == "half":
        model.to(torch.bfloat16)
    if checkpointing:
        enable_gradient_checkpointing(model, 1)  # non-reentrant, as training runs it
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0))
    model.train()
    param_ids = {id(p) for p in model.parameters()}
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations, copies = {}, {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in param_ptrs:  # parameters and views of them are not activations
            target = copies if _is_weight_copy(tensor, param_ids) else activations
            target.setdefault(pointer, storage.nbytes())
        return tensor

    ids = torch.randint(3, cfg.vocab_size, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[0, -max(1, seq // 8):] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids)
    if packed:
        ids = ids.view(1, -1)
        inputs = dict(input_ids=ids, position_ids=torch.arange(seq).repeat(batch).view(1, -1), labels=ids)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        loss = model(**inputs).loss
    loss.backward()  # the graph is complete and usable
    return sum(activations.values()), sum(copies.values())


CASES = [
    # (overrides, batch, seq, mode, checkpointing, attn, padded)
    (dict(), 2, 32, "fp32", False, "sdpa", True),
    (dict(hidden_size=96, intermediate_size=256, num_attention_heads=6, num_key_value_heads=2), 1, 64, "fp32",
     False, "sdpa", True),
    (dict(num_key_value_heads=4), 4, 16, "fp32", False, "sdpa", True),
    (dict(num_attention_heads=8, num_key_value_heads=1, num_hidden_layers=3), 2, 48, "fp32", False, "sdpa", False),
    (dict(), 3, 32, "half", False, "sdpa", True),
    (dict(hidden_size=128, intermediate_size=352, num_attention_heads=8, num_key_value_heads=2), 2, 64, "half",
     False, "sdpa", True),
    (dict(), 2, 32, "autocast", False, "sdpa", True),
    (dict(num_hidden_layers=3, num_key_value_heads=1), 1, 128, "autocast", False, "sdpa", True),
    (dict(), 2, 32, "fp32", False, "eager", True),
    (dict(hidden_size=96, intermediate_size=256, num_attention_heads=6, num_key_value_heads=3), 2, 40, "half",
     False, "eager", True),
    (dict(num_hidden_layers=4), 2, 64, "fp32", True, "sdpa", True),
    (dict(num_hidden_layers=3, hidden_size=128, intermediate_size=352), 1, 256, "half", True, "sdpa", True),
    (dict(num_hidden_layers=3), 4, 32, "autocast", True, "sdpa", True),
]


@pytest.mark.parametrize("overrides,batch,seq,mode,checkpointing,attn,padded", CASES)
def test_activation_estimate_matches_measurement(overrides, batch, seq, mode, checkpointing, attn, padded):
    torch.set_num_threads(1)
    cfg = tiny_llama_config(96, **overrides)
    cfg._attn_implementation = attn
    measured, copies = measure_saved(cfg, batch, seq, mode, checkpointing, padded)
    estimate = saved_activation_bytes(shape_from_config(cfg), batch, seq, mode, checkpointing, attn, padded)
    error = abs(estimate - measured) / measured
    print(f"{mode} ckpt={checkpointing} {attn} b={batch} s={seq}: measured {measured} estimate {estimate} "
          f"error {error:.2%}")
    # The figure of docs/planner.md: within 0.01%. The formula is byte-exact up to the loss scalars (4-12 bytes here).
    assert error < 1e-4
    if mode == "autocast" and not checkpointing:  # every matmul weight cached in 16-bit: counted in buffers
        assert copies == 2 * shape_from_config(cfg).non_embedding_matmul_params


def test_recompute_peak_is_one_full_layer():
    """With recomputation the planner adds one layer's full activations: the difference between measured
    no-recompute runs of 3 and 2 layers."""
    torch.set_num_threads(1)
    shapes = [tiny_llama_config(96, num_hidden_layers=layers) for layers in (2, 3)]
    for cfg in shapes:
        cfg._attn_implementation = "sdpa"
    two, three = (measure_saved(cfg, 2, 32, "half", False, True)[0] for cfg in shapes)
    assert layer_activation_bytes(shape_from_config(shapes[0]), 2, 32, "half") == three - two
    peak = activation_bytes(shape_from_config(shapes[0]), 2, 32, "half", checkpointing=True)
    assert peak["transient"] >= three - two


@pytest.mark.parametrize("name,targets", [("llama-3.1-8b", "all-linear"), ("llama-3.1-70b", "q_proj,v_proj"),
                                          ("qwen2.5-7b", "all-linear")])
def test_lora_trainable_parameters_are_peft_s_count(name, targets):
    """The planner's LoRA count against peft itself, on the real architecture built on the meta device."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(builtin_configs()[name])
    modules = targets if targets == "all-linear" else targets.split(",")
    model = get_peft_model(model, LoraConfig(r=16, target_modules=modules, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert Peft(16, targets).trainable_params(resolve_model(name)) == trainable


def test_70b_lora_fits_one_h100_node_and_qlora_one_gpu():
    shape = resolve_model("llama-3.1-70b")
    lora = plan(shape, H100, config("ds_zero3"), 1, 4096, True, peft=Peft(16))
    assert lora.fits and lora.per_gpu["weights"] == pytest.approx(2 * shape.params / 8, rel=0.01)
    assert lora.per_gpu["optimizer"] < 1e9  # Adam only for the adapters
    assert not plan(shape, H100, config("ddp"), 1, 4096, True, peft=Peft(16)).fits  # 141 GB of bf16 base
    one_gpu = parse_hardware("1xh100-80gb")
    qlora = plan(shape, one_gpu, config("ddp"), 1, 4096, True, peft=Peft(16, load_in_4bit=True))
    adapters = Peft(16).trainable_params(shape)  # fp32
    assert qlora.fits and qlora.per_gpu["weights"] == pytest.approx(0.516 * shape.params + 4 * adapters, rel=1e-3)


# The Llama-3.1-70B figures the DeepSpeed config headers state, and what each one is in the plan on 8xH100-80GB.
CONFIG_HEADER_FIGURES = {
    "ds_zero3": [("model states per GPU", lambda p: p.per_gpu["weights"] + p.per_gpu["gradients"]
                  + p.per_gpu["optimizer"], "GB")],
    "ds_zero3_offload_optimizer": [("model states per GPU", lambda p: p.per_gpu["weights"] + p.per_gpu["gradients"]
                                    + p.per_gpu["optimizer"], "GB"),
                                   ("host RAM per node", lambda p: p.host_ram["offloaded_states"], "TB")],
    "ds_zero3_cpu_offload": [("host RAM per node", lambda p: p.host_ram["offloaded_states"], "TB")],
    "ds_zero3_nvme_offload": [("NVMe per node", lambda p: p.nvme_per_node, "TB"),
                              ("host RAM per node", lambda p: p.host_ram["offloaded_states"], "TB")],
}


@pytest.mark.parametrize("name", CONFIG_HEADER_FIGURES)
def test_config_headers_state_the_planner_s_figures(name):
    header = (Path(CONFIGS_DIR) / f"{name}.yaml").read_text().split("\n")[0]
    planned = plan(resolve_model("llama-3.1-70b"), H100, config(name), 1, 4096, True)
    for what, value, unit in CONFIG_HEADER_FIGURES[name]:
        figure = f"{value(planned) / 1e9:.0f} GB" if unit == "GB" and value(planned) >= 100e9 else (
            f"{value(planned) / 1e9:.1f} GB" if unit == "GB" else f"{value(planned) / 1e12:.1f} TB")
        assert figure in header, f"{name}.yaml's header should state {what} {figure}: {header}"


def test_the_search_tries_selective_checkpointing_before_full():
    """Speed order: no recomputation, then selective (only the cheap ops between the saved matmul outputs are
    recomputed), then full. Selective holds more than full and less than none, so each is chosen exactly where the
    faster ones do not fit."""
    assert Search().recomputations() == [(False, "full"), (True, "selective"), (True, "full")]
    assert Search(checkpointing=True, checkpointing_mode="full").recomputations() == [(True, "full")]
    shape, fsdp = resolve_model("llama-3.1-8b"), read_accelerate_config(os.path.join(CONFIGS_DIR,
                                                                                     "fsdp_full_shard.yaml"))
    held = {mode: plan(shape, H100, fsdp, 4, 4096, on, checkpointing_mode=mode).per_gpu["total"]
            for on, mode in Search().recomputations()}
    assert held["full"] < held["selective"]
    found = recommend(shape, H100, Search(None, 4096, micro_batch=4, checkpointing=True))
    assert (found.plan.config, found.plan.gradient_checkpointing_mode) == ("fsdp_full_shard", "selective")
    assert "gradient checkpointing on (selective)" in found.message
    # Llama-3.1-70B on four nodes at micro-batch 2 without offload: the saved matmul outputs do not fit, full does.
    found = recommend(resolve_model("llama-3.1-70b"), H100.with_nodes(4), Search(64, 4096, micro_batch=2,
                                                                                  checkpointing=True))
    assert found.gpu_only and found.plan.gradient_checkpointing_mode == "full"


def test_the_multi_node_layouts_are_searched_on_several_nodes_only():
    """Hybrid sharding, then hpZ, before sharding over every GPU, on 2 nodes; on one node they plan the same as
    fsdp_full_shard (and ds_zero3 with a second copy of the weights), so they are skipped."""
    def order(hardware):
        seen = []
        for candidate, _, _ in candidates(resolve_model("llama-3.2-1b"), hardware, Search(None, 1024, micro_batch=1,
                                                                                         checkpointing=False)):
            seen += [candidate.config] if candidate.config not in seen else []
        return seen
    two_nodes = order(H100.with_nodes(2))
    assert two_nodes.index("fsdp_hybrid_shard") < two_nodes.index("ds_zero3_hpz") < two_nodes.index(
        "fsdp_full_shard")
    assert two_nodes.index("ds_zero2") < two_nodes.index("fsdp_hybrid_shard")
    assert {"fsdp_hybrid_shard", "ds_zero3_hpz"}.isdisjoint(order(H100))



def test_an_accelerate_config_edited_between_reads_is_read_again(tmp_path):
    """read_accelerate_config keeps each parsed YAML for the searches that read it thousands of times: a file
    rewritten in place to the same size is parsed again (its mtime moved), and a caller never sees another's
    result."""
    path = tmp_path / "launch.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: '1'\n")
    full_shard = read_accelerate_config(str(path))
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: '2'\n")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    grad_op = read_accelerate_config(str(path))
    assert (full_shard.shard, grad_op.shard) == (3, 2), (full_shard, grad_op)

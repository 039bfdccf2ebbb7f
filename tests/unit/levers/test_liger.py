"""--use_liger_kernel without a GPU: its refusals, how it patches a model, and the planner's Liger terms against
what Liger's autograd Functions save.

Liger's kernels are Triton kernels, which do not run on CPU. Where a test runs one of Liger's autograd Functions it
replaces only the kernel launch (the module-level functions the Function calls: rms_norm_forward, swiglu_forward,
the cross-entropy and scaling kernels of the fused loss) by the same math in torch, so that what is checked is
Liger's own Python around them: what each Function saves for backward, how the fused loss chunks its positions,
and how shardtune feeds it. The kernels' numerics are `make gpu-check`'s to measure (losses against the plain
path)."""

from __future__ import annotations

import dataclasses
import math
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama

from shardtune.checks.values import check_lora
from shardtune.config import LIGER_MODEL_TYPES, ConfigError, Recipe
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.levers.liger import apply_liger_kernels, check_liger_device, check_liger_kernel, check_liger_model
from shardtune.levers.tiled_loss import chunked_token_loss, fused_linear_cross_entropy
from shardtune.models.flops import builtin_configs, shape_from_config
from shardtune.models.tiny_assets import tiny_llama_config
from shardtune.plan.activations import (
    layer_activation_bytes,
    liger_chunk_positions,
    liger_loss_saved_bytes,
    liger_loss_transient_bytes,
)

LIGER = Recipe(use_liger_kernel=True)


def refusal(check, *args) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        check(*args)
    return caught.value.messages


# --- refusals -----------------------------------------------------------------------------------------------------

def test_off_cuda_it_is_refused_in_one_line():
    (message,) = refusal(check_liger_device, dataclasses.replace(LIGER, use_cpu=True), False)
    assert message.startswith("--use_liger_kernel runs Liger's Triton kernels, which need a CUDA GPU: drop it")
    check_liger_device(LIGER, True)  # on a GPU, with liger-kernel installed (requirements.txt)
    check_liger_device(Recipe(), False)  # off: nothing to refuse


@pytest.mark.parametrize("fields,start", [
    (dict(chunked_cross_entropy=False), "--use_liger_kernel computes the loss with Liger's fused linear"),
    (dict(torch_compile=True), "--use_liger_kernel with --torch_compile"),
    (dict(gradient_checkpointing_mode="selective"), "--use_liger_kernel with --gradient_checkpointing_mode selective"),
])
def test_each_combination_that_cannot_run_is_refused_in_one_line(fields, start):
    (message,) = refusal(check_liger_kernel, dataclasses.replace(LIGER, **fields))
    assert message.startswith(start) and "\n" not in message
    check_liger_kernel(dataclasses.replace(LIGER, use_liger_kernel=False, **fields))  # without Liger: its own checks


def test_every_refused_combination_is_reported_together():
    recipe = dataclasses.replace(LIGER, chunked_cross_entropy=False, torch_compile=True)
    assert len(refusal(check_liger_kernel, recipe)) == 2


def test_an_lm_head_adapter_is_refused_once_with_liger():
    """check_lora's lm_head refusal names Liger's fused loss and the way out where Liger is on; check_liger_kernel
    leaves it to check_lora."""
    recipe = dataclasses.replace(LIGER, use_peft=True, lora_target_modules="q_proj,lm_head")
    check_liger_kernel(recipe)
    (liger,) = refusal(check_lora, recipe)
    assert liger.startswith("--lora_target_modules lm_head puts an adapter") and "\n" not in liger
    assert liger.endswith("drop --use_liger_kernel and add --chunked_cross_entropy false.")
    (tiled,) = refusal(check_lora, dataclasses.replace(recipe, use_liger_kernel=False))
    assert tiled.endswith("add --chunked_cross_entropy false.")


def test_another_model_family_is_refused():
    (message,) = refusal(check_liger_model, LIGER, types.SimpleNamespace(model_type="gemma"))
    assert message == (f"--use_liger_kernel patches the layers of {', '.join(LIGER_MODEL_TYPES)} models; this "
                       "model's type is 'gemma': drop --use_liger_kernel.")
    for model_type in LIGER_MODEL_TYPES:
        check_liger_model(LIGER, types.SimpleNamespace(model_type=model_type))


# --- the patched model --------------------------------------------------------------------------------------------

@pytest.fixture
def plain_rope(monkeypatch):
    """Liger's RoPE replaces modeling_llama's module-level function for the process: put it back after the test."""
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_the_model_instance_is_patched_not_the_classes(plain_rope, peft):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    model = AutoModelForCausalLM.from_config(tiny_llama_config(97))
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    classes = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    apply_liger_kernels(model)
    base = model.get_base_model() if peft else model
    norms = [base.model.norm] + [m for layer in base.model.layers for m in (layer.input_layernorm,
                                                                             layer.post_attention_layernorm)]
    assert all(norm.forward.__func__ is LigerRMSNorm.forward for norm in norms)
    assert all(layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward for layer in base.model.layers)
    assert modeling_llama.apply_rotary_pos_emb is liger_rotary_pos_emb
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == classes  # later models build their own
    assert type(AutoModelForCausalLM.from_config(tiny_llama_config(97)).model.norm) is modeling_llama.LlamaRMSNorm
    assert base.get_output_embeddings().forward.__func__ is torch.nn.Linear.forward  # the loss is shardtune's


# --- Liger's Functions with their kernels in torch --------------------------------------------------------------

def rms_norm_forward(X, W, eps, offset, casting_mode, row_mode):
    """ops/rms_norm.py's rms_norm_forward in torch (Llama casting: fp32 statistics, the weight times x in X's
    dtype); it returns X as a 2-D view, as Liger's does."""
    shape = X.shape
    X = X.view(-1, shape[-1])
    rstd = torch.rsqrt(X.float().pow(2).mean(-1) + eps)
    Y = W * (X.float() * rstd[:, None]).to(X.dtype)
    return Y.view(*shape), X, rstd, 0, 0, casting_mode


def swiglu_forward(a, b, gate_multiplier=1.0):
    shape = b.shape
    a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
    return a, b, (F.silu(a) * b).view(*shape)


class CrossEntropyKernel:
    """liger_cross_entropy_kernel[grid](...) in torch, for reduction "sum": each row's loss, and its gradient
    written over the logits (softmax less the one-hot target; zero for an ignored row). Counts its launches."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        return self.run

    def run(self, X_ptr, Y_ptr, loss_ptr, ignore_index, reduction, HAS_GRADIENTS, **_):
        assert reduction == "sum"
        self.launches += 1
        kept = Y_ptr != ignore_index
        log_probs = X_ptr.float().log_softmax(-1)
        rows, safe = torch.arange(len(Y_ptr)), Y_ptr.clamp(min=0)
        loss_ptr.copy_(-log_probs[rows, safe] * kept)
        if HAS_GRADIENTS:
            gradient = log_probs.exp()
            gradient[rows, safe] -= 1
            X_ptr.copy_(gradient * kept[:, None])


def element_mul(X, X_stride, grad_output, n_cols, **_):
    X.mul_(grad_output)


@pytest.fixture
def torch_kernels(monkeypatch) -> CrossEntropyKernel:
    import liger_kernel.ops.fused_linear_cross_entropy as fused
    import liger_kernel.ops.rms_norm as rms_norm
    import liger_kernel.ops.swiglu as swiglu

    kernel = CrossEntropyKernel()
    monkeypatch.setattr(fused, "liger_cross_entropy_kernel", kernel)
    monkeypatch.setattr(fused, "element_mul_kernel", ElementMul())
    monkeypatch.setattr(rms_norm, "rms_norm_forward", rms_norm_forward)
    monkeypatch.setattr(swiglu, "swiglu_forward", swiglu_forward)
    return kernel


class ElementMul:
    def __getitem__(self, grid):
        return element_mul


def batch_of(vocab: int, rows: int, positions: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (rows, positions), generator=generator)
    labels = input_ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_the_fused_loss_and_its_gradients_equal_the_tiled_loss(torch_kernels, tie):
    """Through the LM head's swapped-in forward, as the step runs it (shardtune.levers.tiled_loss), on fp32 weights: the
    loss divided by the global target count and every gradient, the head's (computed in Liger's forward) and the
    layers' behind it, as the tiles give them."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(97, tie_word_embeddings=tie), dtype=torch.float32)
    batch, targets = batch_of(97, 3, 40), torch.tensor(250.0)
    results = []
    for fused in (True, False):
        model.zero_grad()
        loss = chunked_token_loss(model, model, batch, targets, tile=16, fused=fused)
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (fused_loss, fused_grads), (tiled_loss, tiled_grads) = results
    assert torch_kernels.launches > 1  # chunked
    torch.testing.assert_close(fused_loss, tiled_loss, rtol=1e-6, atol=0)  # fp32 sums in another order
    for name, grad in tiled_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def saved_bytes(run) -> list[torch.Tensor]:
    """The tensors autograd saves while `run()` runs, each storage once. The graph keeps only their addresses (this
    list keeps the tensors, so that no address is reused meanwhile): a graph that kept a saved output itself would
    hold it in a reference cycle through its grad_fn that no backward here breaks and Python's gc cannot see."""
    saved = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        saved.setdefault(pointer, tensor)
        return pointer

    def unpack(pointer):
        raise AssertionError("measured forwards are not differentiated")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        run()
    return list(saved.values())


@pytest.mark.parametrize("mode,dtype", [("fp32", torch.float32), ("half", torch.bfloat16)])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_the_fused_loss_saves_what_the_planner_counts(torch_kernels, mode, dtype, frozen):
    """LigerFusedLinearCrossEntropyFunction saves the two gradients it computed, nothing else; its chunks are
    liger_chunk_positions long (n / ceil(vocab / hidden), a power of two)."""
    shape = shape_from_config(tiny_llama_config(1000, hidden_size=64))
    n = 300
    hidden = torch.randn(n, shape.hidden, dtype=dtype, requires_grad=True)
    weight = torch.randn(shape.vocab, shape.hidden, dtype=dtype, requires_grad=not frozen)
    labels = torch.randint(0, shape.vocab, (n,))
    labels[:20] = IGNORE_INDEX
    saved = saved_bytes(lambda: fused_linear_cross_entropy(hidden, weight, labels, torch.tensor(280.0)))
    saved = [tensor for tensor in saved if tensor.dim()]  # the division by the target count saves that scalar
    shapes = sorted(tuple(tensor.shape) for tensor in saved)
    assert shapes == sorted([(n, shape.hidden)] + ([] if frozen else [(shape.vocab, shape.hidden)]))
    assert sum(t.numel() * t.element_size() for t in saved) == liger_loss_saved_bytes(shape, n, mode, frozen)
    chunk = liger_chunk_positions(shape, n)
    assert chunk == 32 and torch_kernels.launches == math.ceil(n / chunk)  # 300 / ceil(1000 / 64): 19, then 32


def test_the_chunk_is_liger_s():
    """liger_chunk_positions against the arithmetic of fused_linear_cross_entropy_forward, with triton's own
    helpers, over Llama 3's shapes and odd ones."""
    import triton

    for n in (1, 7, 300, 4096, 8192, 65536):
        for hidden, vocab in ((2048, 128256), (4096, 128256), (8192, 128256), (3584, 152064), (64, 1000)):
            shape = dataclasses.replace(shape_from_config(tiny_llama_config(vocab)), hidden=hidden)
            expected = min(triton.next_power_of_2(triton.cdiv(n, triton.cdiv(vocab, hidden))), n)
            assert liger_chunk_positions(shape, n) == expected, (n, hidden, vocab)


def layers_saved_bytes(config, batch: int, seq: int, dtype: torch.dtype, liger: bool) -> int:
    """Bytes the decoder stack saves for backward in one forward (no head, no mask: an unpadded batch), parameters
    left out, each storage once."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if liger:
        apply_liger_kernels(model)
        modeling_llama.apply_rotary_pos_emb = ROPE  # Liger's RoPE dispatches to a Triton kernel: the plain one
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(3, config.vocab_size, (batch, seq))
    saved = saved_bytes(lambda: model.model(input_ids=ids))
    return sum(t.untyped_storage().nbytes() for t in saved if t.untyped_storage().data_ptr() not in params)


ROPE = modeling_llama.apply_rotary_pos_emb
LAYER_SHAPE = dict(hidden_size=96, intermediate_size=256, num_attention_heads=6)


def one_layer_saved_bytes(mode: str) -> dict[bool, int]:
    """One decoder layer's saved bytes (3 layers less 2), plain and with Liger's Functions (their kernels in torch),
    in a process of its own: run in the test's process, freeing these tensors moved later tests' profiler-measured
    peaks (tests/unit/plan/test_plan_accuracy.py)."""
    import liger_kernel.ops.rms_norm as rms_norm
    import liger_kernel.ops.swiglu as swiglu

    rms_norm.rms_norm_forward, swiglu.swiglu_forward = rms_norm_forward, swiglu_forward
    dtype = {"fp32": torch.float32, "half": torch.bfloat16}[mode]
    two, three = ({liger: layers_saved_bytes(tiny_llama_config(97, num_hidden_layers=layers, **LAYER_SHAPE), 2, 24,
                                             dtype, liger) for liger in (False, True)} for layers in (2, 3))
    return {liger: three[liger] - two[liger] for liger in (False, True)}


@pytest.mark.parametrize("mode", ["fp32", "half"])
def test_a_liger_layer_saves_what_the_planner_counts(mode):
    """One decoder layer's saved bytes with Liger's RMSNorm and SwiGLU Functions: the norms keep their input and
    fp32 rstd, the MLP gate's and up's outputs and the product. The plain layer is measured by the same harness
    against the plain count first."""
    import json
    import os
    import subprocess
    import sys

    code = (f"import json; from tests.unit.levers.test_liger import one_layer_saved_bytes as m; "
            f"print(json.dumps(m({mode!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[3], env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    measured = {key == "true": value for key, value in json.loads(result.stdout.splitlines()[-1]).items()}
    shape = shape_from_config(tiny_llama_config(97, **LAYER_SHAPE))
    for liger in (False, True):
        assert measured[liger] == layer_activation_bytes(shape, 2, 24, mode, masked=False, liger=liger), liger
    residual, n = (4 if mode == "fp32" else 2), 2 * 24
    # No fp32 copies and no normalised x in the two norms, no SiLU output in the MLP.
    assert measured[False] - measured[True] == 2 * (4 * n * shape.hidden) + residual * n * shape.intermediate


def test_liger_rope_saves_cos_and_sin_only(monkeypatch):
    import liger_kernel.ops.rope as rope
    from liger_kernel.ops import LigerRopeFunction

    def rope_forward(q, k, cos, sin, position_ids, unsqueeze_dim, rotary_dim):
        q, k = ROPE(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return q, k, cos, sin

    monkeypatch.setattr(rope, "rope_forward", rope_forward)
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    k = torch.randn(2, 2, 8, 16, requires_grad=True)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    saved = saved_bytes(lambda: LigerRopeFunction.apply(q, k, cos, sin))
    assert {t.untyped_storage().data_ptr() for t in saved} == {cos.untyped_storage().data_ptr(),
                                                               sin.untyped_storage().data_ptr()}


def test_the_fused_loss_transient_of_an_8b_step():
    """The fused loss's forward over 2 x 4096 positions of Llama-3.1-8B's head under FSDP2's bf16 compute: one
    chunk of 256 positions' bf16 logits and the fp32 weight-gradient accumulator (the bf16 gradient it saves is
    made from it at the end: the accumulator then sits beside it), and 13 bytes a position; nothing in its
    backward, which scales the saved gradients in place."""
    shape = shape_from_config(builtin_configs()["llama-3.1-8b"])
    n, h, vocab = 8192, shape.hidden, shape.vocab
    assert liger_chunk_positions(shape, n) == 256  # 8192 / ceil(128256 / 4096) = 8192 / 32
    during = (4 - 2) * vocab * h + 2 * 256 * vocab
    assert liger_loss_transient_bytes(shape, n, "half") == max(during, 4 * vocab * h) + 13 * n
    assert liger_loss_transient_bytes(shape, n, "half", moment="backward") == 0
    assert liger_loss_transient_bytes(shape, n, "half", frozen=True) == 2 * 256 * vocab + 13 * n
    assert liger_loss_saved_bytes(shape, n, "half") == 2 * n * h + 2 * vocab * h


# --- the flag in --help and in the planner ------------------------------------------------------------------------

def test_the_flag_says_what_it_does_in_help(monkeypatch, capsys):
    from shardtune.flags import recipe_parser
    from shardtune.plan.__main__ import main as plan_main

    monkeypatch.setenv("COLUMNS", "1000")
    recipe_help = " ".join(recipe_parser(Recipe()).format_help().split())
    assert "--use_liger_kernel" in recipe_help and "Liger's Triton kernels (CUDA GPUs)" in recipe_help
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    assert "--use_liger_kernel" in capsys.readouterr().out


def plan_json(capsys, *flags: str) -> dict:
    import json

    from shardtune.plan.__main__ import main as plan_main

    code = plan_main(["--model", "llama-3.1-8b", "--json", *flags])
    output = capsys.readouterr()
    assert code in (0, 1), output.err
    return json.loads(output.out)


def test_the_plan_json_carries_the_field_and_its_activations(capsys):
    """One config, no recomputation, micro-batch 1 x 4096: Liger's plan differs from the tiled one's by the
    Liger terms alone."""
    flags = ("--config_file", "accelerate_configs/fsdp_full_shard.yaml", "--gradient_checkpointing", "false",
             "--per_device_train_batch_size", "1", "--max_seq_length", "4096")
    tiled, liger = plan_json(capsys, *flags), plan_json(capsys, *flags, "--use_liger_kernel", "true")
    assert (tiled["use_liger_kernel"], liger["use_liger_kernel"]) == (False, True)
    shape, n = shape_from_config(builtin_configs()["llama-3.1-8b"]), 4096
    fewer = shape.layers * (layer_activation_bytes(shape, 1, n, "half", liger=False)
                            - layer_activation_bytes(shape, 1, n, "half", liger=True))
    assert fewer > 0 and liger["phases"]["forward_backward"]["activations"] != tiled["phases"]["forward_backward"][
        "activations"]


def test_the_planner_refuses_what_the_recipe_refuses(capsys):
    from shardtune.plan.__main__ import main as plan_main

    assert plan_main(["--model", "llama-3.1-8b", "--use_liger_kernel", "true", "--chunked_cross_entropy",
                      "false"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("shardtune.plan: error: --use_liger_kernel computes the loss with Liger's fused")


def test_the_search_with_liger_skips_selective_checkpointing():
    """Liger's in-place RoPE is refused with selective checkpointing: its search tries none, then full, and a plan
    of it is refused."""
    from shardtune.plan.hardware import parse_hardware
    from shardtune.plan.planner import plan
    from shardtune.plan.search import Search
    from shardtune.plan.strategy import PlanError, read_accelerate_config

    assert Search().recomputations() == [(False, "full"), (True, "selective"), (True, "full")]
    assert Search(use_liger_kernel=True).recomputations() == [(False, "full"), (True, "full")]

    shape = shape_from_config(builtin_configs()["llama-3.1-8b"])
    strategy = read_accelerate_config("accelerate_configs/fsdp_full_shard.yaml", "bf16")
    with pytest.raises(PlanError, match="selective checkpointing keeps"):
        plan(shape, parse_hardware("8xh100-80gb"), strategy, checkpointing_mode="selective",
             chunked_cross_entropy=True, use_liger_kernel=True)

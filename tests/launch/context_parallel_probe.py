"""Launched by tests/launch/test_context_parallel.py under `accelerate launch` in place of recipes/tiny.py, with its
flags: the recipe's own run, on CPU, after one addition torch lacks there. torch 2.13's context parallelism maps
CUDA's flash, memory-efficient and cuDNN attention ops into its ring attention, and no CPU op: this maps the op SDPA
runs on CPU (aten._scaled_dot_product_flash_attention_for_cpu) and its backward into the same ring, torch's own
_templated_ring_attention and _templated_ring_attention_backward (the key/value rotation over gloo, the load
balancing, the log-sum-exp merge). Everything else is what runs on GPUs: accelerate's CP mesh and
maybe_context_parallel, FSDP2 over dp_shard x cp, the trainer's shifted labels, loss scale, counts, eval and
checkpoints. shardtune refuses CP on CPU by reading torch's table (ring_attention_runs_on_cpu): with this entry in
it, the run goes ahead."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # (batch, heads, positions, head_dim), as torch's own handlers hard-code it


def cpu_ring_attention(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[DTensor, ...]:
    """The CPU flash op (forward or backward) on the DTensors CP's patched SDPA made, run around the ring on their
    local chunks; the results wrapped as the chunks they are."""
    mesh = next(arg for arg in args if isinstance(arg, DTensor)).device_mesh
    local = [arg.to_local() if isinstance(arg, DTensor) else arg for arg in args]
    group, scale = mesh.get_group(), kwargs.get("scale")
    if op_call is FORWARD:
        query, key, value = local[:3]
        dropout_p = local[3] if len(local) > 3 else kwargs.get("dropout_p", 0.0)
        is_causal = local[4] if len(local) > 4 else kwargs.get("is_causal", False)
        assert kwargs.get("attn_mask") is None, "the ring attention takes no mask"
        results = _attention._templated_ring_attention(group, SEQ_DIM, FORWARD, query=query, key=key, value=value,
                                                       is_causal=is_causal, dropout_p=dropout_p, scale=scale)[:2]
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = local[:8]
        results = _attention._templated_ring_attention_backward(
            group, SEQ_DIM, BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
            value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)[:3]
    return tuple(DTensor.from_local(result, mesh, [Shard(SEQ_DIM)], run_check=False) for result in results)


_attention.custom_ops[FORWARD] = cpu_ring_attention
_attention.custom_ops[BACKWARD] = cpu_ring_attention

if __name__ == "__main__":
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny.py"
    sys.argv[0] = str(recipe)
    runpy.run_path(str(recipe), run_name="__main__")

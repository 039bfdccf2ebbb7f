"""--torch_compile: regional compilation of the decoder layers, and the compile figures a run logs.

Each decoder layer's `__call__` is compiled in place (`module.compile()`) by accelerate's regional compilation for
FSDP2 (`compile_regions_fsdp2`), applied to the model's repeated blocks only:
- In place, under every strategy: the call still goes through `nn.Module._call_impl`, so FSDP2's and ZeRO-3's
  hooks on the layer and its linears run (both are `torch.compiler.disable`d, so dynamo runs them eagerly), the
  module tree and its state-dict keys stay as they were (checkpoints resume with or without compilation), and
  `unwrap_model` still finds the model. `Accelerator.prepare`'s own DDP path (`compile_regions`) copies the parent
  modules and wraps each block in an OptimizedModule instead: its state-dict keys gain `_orig_mod.`.
- The layers only: accelerate also compiles every other leaf (embedding, final norm, rotary embedding, LM head),
  and the tiled loss (shardtune.levers.tiled_loss) runs as the head's forward, a new closure each step: a compiled head
  recompiles at every step (measured: once per new sequence length) until dynamo's recompile limit.
The layers are instances of one class and share one code object, so they share their compiled graphs: a model
compiles once whatever its depth. A changed sequence length recompiles once, with that dimension dynamic (dynamo's
automatic dynamic shapes); after that varying lengths reuse the dynamic graph.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.utils.other import compile_regions_fsdp2, is_repeated_blocks

from shardtune.config import Recipe


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's first list of same-class blocks (accelerate's `is_repeated_blocks`): a Llama's decoder layers,
    under a peft wrapper too."""
    for module in model.modules():
        if is_repeated_blocks(module):
            return module
    raise ValueError(f"{type(model).__name__} has no list of repeated blocks to compile")


def compile_decoder_layers(model: torch.nn.Module, recipe: Recipe) -> int:
    """Compile each decoder layer of `model` in place with the recipe's backend and mode; the number compiled."""
    layers = decoder_layers(model)
    compile_regions_fsdp2(layers, backend=recipe.torch_compile_backend, mode=recipe.torch_compile_mode)
    return len(layers)


def local_compile_figures() -> dict[str, float]:
    """This process's compilation so far: frames dynamo compiled (each recompilation counts one more; a graph
    break's resumed frame too) and the seconds spent compiling, forward and backward graphs together."""
    from torch._dynamo.utils import calculate_time_spent, counters

    return {"compiled_frames": float(counters["frames"]["ok"]),
            "compile_seconds": float(calculate_time_spent().get("total_wall_time", 0.0))}


def compile_figures(accelerator: Accelerator) -> dict[str, float]:
    """local_compile_figures, each the largest over the ranks (a rank compiles for the shapes of its own batches).
    A collective: every rank calls it."""
    local = local_compile_figures()
    ranks = accelerator.gather(torch.tensor(list(local.values()), dtype=torch.float64, device=accelerator.device))
    return dict(zip(local, ranks.view(-1, len(local)).max(dim=0).values.tolist(), strict=True))


@contextmanager
def eager_calls():
    """Run compiled modules eagerly inside: generation feeds the layers a KV cache and one token at a time, shapes
    and objects the training graphs were not made for (each would be a recompilation)."""
    with torch.compiler.set_stance("force_eager"):
        yield

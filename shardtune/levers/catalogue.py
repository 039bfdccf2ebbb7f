"""The speed and memory levers, as the recipe flags that turn each on over the plain path: one list for
`scripts/bench.py --levers` and the docs. The planner's search (shardtune.plan.search) decides which a run needs.

The plain path turns every lever off. Each lever's row adds its own flags to it; the recommended combination adds
those of every lever marked `always` that runs here: the ones that cost no precision (the planner steps down to
the optimizers that trade it only where no exact run fits the GPUs, OPTIMIZER_LADDER). The plain path keeps the
recipe's --mixed_precision; the float8 lever sets fp8 over it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.config import FP8_MIN_CAPABILITY

# Every lever off: the loss over the full logits, eager layers, full checkpointing where the recipe checkpoints,
# micro-batches packed as they come, saved activations on the accelerator, torch's AdamW over an fp32 master, the
# plain norms, MLP and RoPE.
PLAIN_FLAGS = ("--chunked_cross_entropy", "false", "--torch_compile", "false", "--gradient_checkpointing_mode",
               "full", "--packing_strategy", "padding_free", "--activation_offloading", "false", "--optim",
               "adamw_torch", "--bf16_stochastic_round", "false", "--use_liger_kernel", "false")


def over(base: tuple[str, ...], flags: tuple[str, ...]) -> tuple[str, ...]:
    """`flags` (pairs of --name value) over `base`: each flag once, at the last value given (a recipe refuses a flag
    given twice with two values)."""
    merged = dict(zip(base[::2], base[1::2], strict=True))
    merged.update(zip(flags[::2], flags[1::2], strict=True))
    return tuple(token for pair in merged.items() for token in pair)


@dataclass(frozen=True)
class Lever:
    name: str
    flags: tuple[str, ...]  # over PLAIN_FLAGS
    always: bool = False  # in the recommended combination wherever it runs (it costs no precision)
    cuda_only: bool = False  # checks.values refuses it elsewhere
    deepspeed: bool = True  # runs under DeepSpeed (its engine steps its own fp32 master with torch's AdamW)
    fsdp_or_one_process: bool = False  # stochastic rounding: DDP's replicas would round apart
    needs_bf16: bool = False
    needs_packing: bool = False
    zero3: bool = True  # runs under ZeRO-3 (compile does not: shardtune.checks.values.check_compile_under)
    min_capability: tuple[int, int] | None = None  # the GPU's compute capability it needs (fp8: float8 tensor cores)

    def runs(self, kind: str, shard: int, processes: int, mixed_precision: str, packing: bool, cuda: bool,
             capability: tuple[int, int] | None = None) -> str:
        """'' when the lever runs under this launch (`shard`: the ZeRO stage), else why not, in a few words.
        `capability`: the GPU's compute capability, where known."""
        if self.cuda_only and not cuda:
            return "needs CUDA"
        if self.min_capability and capability is not None and tuple(capability) < self.min_capability:
            return f"needs compute capability {'.'.join(map(str, self.min_capability))}"
        if kind == "deepspeed" and not self.deepspeed:
            return "not under DeepSpeed"
        if kind == "deepspeed" and shard >= 3 and not self.zero3:
            return "not under ZeRO-3"
        if self.fsdp_or_one_process and kind != "fsdp" and processes > 1:
            return "FSDP2 or one process"
        if self.needs_bf16 and mixed_precision != "bf16":
            return "needs --mixed_precision bf16"
        if self.needs_packing and not packing:
            return "needs --packing true"
        return ""


LEVERS = (
    Lever("loss in tiles", ("--chunked_cross_entropy", "true"), always=True),
    Lever("compiled layers", ("--torch_compile", "true"), always=True, zero3=False),
    Lever("selective checkpointing", ("--gradient_checkpointing", "true", "--gradient_checkpointing_mode",
                                      "selective")),
    Lever("packing to full rows", ("--packing_strategy", "bfd"), always=True, needs_packing=True),
    # Every layer recomputed: a layer that is not would offload its weights too (shardtune.checks.startup).
    Lever("activation offloading, layers recomputed",
          ("--gradient_checkpointing", "true", "--gradient_checkpointing_interval", "1", "--activation_offloading",
           "true"), cuda_only=True),
    # Liger's fused loss replaces the tiles and runs in their place (shardtune.levers.liger.check_liger_kernel); not in
    # the recommended combination: it is refused with compile, which is.
    Lever("Liger kernels", ("--chunked_cross_entropy", "true", "--use_liger_kernel", "true"), cuda_only=True),
    Lever("8-bit AdamW states", ("--optim", "adamw_torch_8bit"), deepspeed=False),
    Lever("4-bit states, no fp32 master", ("--optim", "adamw_torch_4bit", "--bf16_stochastic_round", "true"),
          deepspeed=False, fsdp_or_one_process=True, needs_bf16=True),
    # Trades precision (the layers' matmuls in float8), so never `always`; the plain path keeps the recipe's precision.
    Lever("float8 linears", ("--mixed_precision", "fp8"), cuda_only=True, deepspeed=False,
          min_capability=FP8_MIN_CAPABILITY),
)

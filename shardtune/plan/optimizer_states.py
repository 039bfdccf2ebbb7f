"""Bytes of the optimizer states of `--optim` on one rank, tensor by tensor, as each library allocates them.

- adamw_torch: torch AdamW's exp_avg and exp_avg_sq in the parameters' dtype (model_states counts them as 8P, its
  4-byte step counters left out).
- adamw_torch_8bit / adamw_torch_4bit: torchao (torchao/optim/adam.py `_new_buffer`) quantizes a local tensor of
  at least TORCHAO_MIN_QUANTIZED elements whose count is a multiple of the block size (256, see
  config.TORCHAO_BLOCK_SIZE); any other keeps both states in the parameter's dtype. A quantized state holds its
  codes (1 byte per element in 8 bits, half a byte in 4), one fp32 scale per block and its own fp32 lookup table
  (256 entries in 8 bits, 16 in 4: subclass_8bit.py / subclass_4bit.py `zeros`). Each parameter adds a 4-byte step.
- --bf16_stochastic_round: the torchao names as above over bf16 parameters (their unquantized states bf16, the
  scales and lookup tables fp32); with adamw_torch, torchao's AdamW: both states bf16, a 4-byte step.
- adamw_8bit / paged_adamw_8bit: bitsandbytes' 8-bit blockwise states for tensors of at least 4096 elements
  (min_8bit_size), one fp32 absmax per block of 256, fp32 states below that (not measured here: CUDA only).
FSDP2 shards every parameter on dim 0: a rank holds ceil(rows / N) rows, so whether a tensor is quantized depends
on its local shape."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from shardtune.config import BITSANDBYTES_OPTIMIZERS, TORCHAO_BLOCK_SIZE, TORCHAO_OPTIMIZERS
from shardtune.models.flops import ModelShape

TORCHAO_MIN_QUANTIZED = 4096  # "follow bitsandbytes, only quantize tensors >= 4096 values"
BNB_MIN_8BIT = 4096
BNB_BLOCK = 256
STEP_BYTES = 4  # torchao's state["step"]: an fp32 scalar per parameter
QMAP_ENTRIES = {"adamw_torch_8bit": 256, "adamw_torch_4bit": 16}
CODE_BYTES = {"adamw_torch_8bit": 1.0, "adamw_torch_4bit": 0.5}


@lru_cache(maxsize=64)  # the search plans one shape thousands of times; callers only read the list
def parameter_matrices(shape: ModelShape) -> list[tuple[int, int]]:
    """(rows, columns) of every parameter of a dense decoder as torch holds it (Linear: out x in; norms and
    biases: elements x 1; a packed expert tensor as experts·rows x columns), in `model.parameters()` order
    (states.parameter_sizes' elements)."""
    h = shape.hidden
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layer = [(q_dim, h), *([(q_dim, 1)] if shape.qkv_bias else []),
             (kv_dim, h), *([(kv_dim, 1)] if shape.qkv_bias else []),
             (kv_dim, h), *([(kv_dim, 1)] if shape.qkv_bias else []),
             (h, q_dim), *([(h, 1)] if shape.o_bias else []), *[(norm, 1) for norm in shape.qk_norms]]
    for rows, columns in shape.mlp_matrices():
        layer += [(rows, columns)] + ([(rows, 1)] if shape.mlp_bias else [])
    matrices = [(shape.vocab, h)] + (layer + [(h, 1)] * shape.layer_norms) * shape.layers + [(h, 1)]
    return matrices + ([] if shape.tied else [(shape.vocab, h)])


def local_elements(rows: int, columns: int, shards: int) -> int:
    """Elements of the largest rank's piece of a parameter sharded on dim 0 over `shards` ranks (1: whole)."""
    return -(-rows // shards) * columns


def tensor_state_bytes(optim: str, elements: int, weight_bytes: int, stochastic: bool = False) -> float:
    """Bytes of Adam's two states (and step) of one local tensor of `elements` under `optim`; `stochastic`:
    --bf16_stochastic_round, which steps adamw_torch with torchao's AdamW."""
    full = 2.0 * weight_bytes * elements
    if optim in TORCHAO_OPTIMIZERS:
        if elements < TORCHAO_MIN_QUANTIZED or elements % TORCHAO_BLOCK_SIZE:
            return full + STEP_BYTES
        one = CODE_BYTES[optim] * elements + 4 * elements // TORCHAO_BLOCK_SIZE + 4 * QMAP_ENTRIES[optim]
        return 2 * one + STEP_BYTES
    if optim in BITSANDBYTES_OPTIMIZERS:
        if elements < BNB_MIN_8BIT:
            return 2.0 * 4 * elements + STEP_BYTES
        return 2.0 * (elements + 4 * -(-elements // BNB_BLOCK)) + STEP_BYTES
    return full + STEP_BYTES if stochastic else full


def optimizer_state_bytes(optim: str, matrices: list[tuple[int, int]], shards: int, weight_bytes: int,
                          stochastic: bool = False) -> float:
    """Bytes of every trainable tensor's optimizer states on the largest rank: `matrices` their (rows, columns),
    `shards` 1 (DDP) or the FSDP world, `weight_bytes` the parameters' bytes per element."""
    # A model repeats a few shapes many times: each distinct local piece is counted once, times its count
    # (integer-valued bytes well below 2**53: the same sum, exactly).
    pieces = Counter(local_elements(rows, columns, shards) for rows, columns in matrices)
    return float(sum(count * tensor_state_bytes(optim, elements, weight_bytes, stochastic)
                     for elements, count in pieces.items()))


# torchao's eager step (adam.py `single_param_adam` run without torch.compile, as on CPU): its fp32 temporaries of
# one tensor, bytes per element above the states, measured with the profiler on torch 2.13 (tests/unit/
# levers/test_optimizers.py): the quantized states' dequantized copies and one scale per block besides; bf16 weights add
# their fp32 upcast. Compiled (the default on CUDA) inductor fuses most of them: this bounds it from above.
TORCHAO_STEP_BYTES = {(True, False): 53 + 4 / TORCHAO_BLOCK_SIZE, (True, True): 57 + 4 / TORCHAO_BLOCK_SIZE,
                      (False, True): 41.0}


def torchao_step_bytes(optim: str, stochastic: bool, largest_local_elements: int) -> float:
    """The transient of torchao's step, which updates one tensor at a time: its largest local tensor's
    temporaries (TORCHAO_STEP_BYTES; the quantized path's for a tensor it quantizes)."""
    return TORCHAO_STEP_BYTES[(optim in TORCHAO_OPTIMIZERS, stochastic)] * largest_local_elements

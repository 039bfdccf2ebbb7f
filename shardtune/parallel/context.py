"""Context parallelism: every sequence of a micro-batch cut along its length over the cp ranks of a group by torch's
ring attention, as accelerate wires it (ParallelismConfig cp_size, FSDP2 only: accelerate_configs/fsdp_cp.yaml).
Each rank holds 1/cp of every row's positions, in two chunks (torch's head-tail load balancing under the causal
mask: rank r of cp holds chunks r and 2cp-1-r); attention runs in cp rounds, the key/value chunks passed around the
group (all-gathered, or one chunk at a time with cp_comm_strategy alltoall) and the partial outputs merged by their
log-sum-exp. Everything else a layer does is per position: activations, logits and the loss's tiles are 1/cp per
rank. FSDP2 shards the states over dp_shard x cp (accelerate's dp_shard_cp mesh).

How the trainer drives it:
- Data. The ranks of a group run the same micro-batches (accelerate's prepared loaders deal rows to world / cp data
  ranks, data_loader.py prepare_data_loader). Rows are padded on the right to a multiple of 2 x cp (the collator's
  multiple) and carry position ids and no mask: torch's ring attention runs the causal kernel without one, and the
  padding comes after every real token. Packing would let a row's sequences attend to each other: refused.
- Each micro-batch. The labels are shifted before the cut (`shift_labels`: a chunk's last position's label is the
  next chunk's first token), then accelerate's maybe_context_parallel cuts input_ids, position_ids and the shifted
  labels in place and patches scaled_dot_product_attention for the forward and the backward inside it.
- Loss. Each rank's chunks' target tokens over the global batch's target count: summed over the group, each token
  counted once. The rows' counts (targets, tokens, sequences) are counted on the group's first rank only
  (shardtune.parallel.groups.counted_here), the loss on every rank (loss_counted_here).
- Gradients. FSDP2 averages over every rank of its dp_shard_cp mesh (world): the step scales the loss by
  accumulation x (world / cp) x cp.
- Eval runs under the split too, its per-row statistics summed over the group; generation runs unsplit, every
  rank of a group the same prompts, each cut to its last max_seq_length / cp tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from shardtune.config import ConfigError, Recipe

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from transformers import PretrainedConfig

# The one kernel torch's ring attention patches (F.scaled_dot_product_attention); transformers' eager, flex and
# flash attention never call it.
CONTEXT_ATTENTION = ("sdpa",)
# The tensors of a micro-batch cut along their length (dimension 1): the model's inputs and the shifted labels.
SPLIT_KEYS = ("input_ids", "position_ids", "shift_labels")


def context_parallel_size(accelerator: Accelerator) -> int:
    """The ranks each sequence is cut over by the ring attention in a prepared run (1 without CP)."""
    config = accelerator.parallelism_config
    return config.cp_size if config is not None and config.cp_enabled else 1


def context_parallel_rank(accelerator: Accelerator) -> int:
    """This rank's place in its context-parallel group (0 without CP; accelerate's own property raises)."""
    return accelerator.torch_device_mesh.get_local_rank("cp") if context_parallel_size(accelerator) > 1 else 0


def row_multiple(cp_size: int) -> int:
    """What a row's length must be a multiple of: 2 x cp, each rank's two chunks of torch's load balancing."""
    return 2 * cp_size if cp_size > 1 else 1


def with_shifted_labels(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The micro-batch as the split needs it: `shift_labels` in place of `labels` (each position's next-token
    label, made before the cut), no attention mask (the rows are right-padded; the ring attention takes none)."""
    from shardtune.levers.tiled_loss import shifted_labels

    kept = {key: value for key, value in batch.items() if key not in ("labels", "attention_mask")}
    return {**kept, "shift_labels": shifted_labels(batch["labels"]).contiguous()}


@contextmanager
def context_parallel(accelerator: Accelerator, batch: dict[str, torch.Tensor], cp_size: int
                     ) -> Iterator[dict[str, torch.Tensor]]:
    """Run the block (a forward and its backward) on this rank's chunks of `batch`: with_shifted_labels, its
    SPLIT_KEYS tensors cut in place by accelerate's maybe_context_parallel (and left cut), SDPA patched inside.
    Without a split (`cp_size` 1), the batch as it is."""
    if cp_size == 1:
        yield batch
        return
    batch = with_shifted_labels(batch)
    buffers = [batch[key] for key in SPLIT_KEYS]
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                            no_restore_buffers=set(buffers)), one_sequence_per_row():
        yield batch


@contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """transformers reads a jump in a row's position ids as the boundary of packed sequences
    (masking_utils.find_packed_sequence_indices, with a device-to-host sync) and builds a dense mask of the chunk's
    positions for them, which accelerate's CP hooks then drop: at 131,072 tokens over 8 ranks, 256 MiB per row in
    every forward. Under the split each row is one sequence (packing is refused) and its jumps are the load
    balancer's, where rank r's two chunks meet: inside, transformers is told so."""
    from transformers import masking_utils

    found = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = found


def context_group(accelerator: Accelerator) -> object:
    """This rank's context-parallel process group (the mesh's cp axis)."""
    return accelerator.torch_device_mesh["cp"].get_group()


def ring_attention_runs_on_cpu() -> bool:
    """Whether torch's context parallelism handles the attention op SDPA runs on CPU: torch 2.13's dispatches
    only CUDA's flash, memory-efficient and cuDNN kernels (torch/distributed/tensor/experimental/_context_parallel
    _attention.py custom_ops); on CPU it would raise inside the first forward."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in _attention.custom_ops


def check_context_parallel(recipe: Recipe, cp_size: int, on_gpu: bool = True) -> None:
    """What the context split needs of the recipe: the kernel torch's ring attention patches, rows that do not
    attend to each other, a length its load balancing divides, a device it runs on, and none of the levers that
    replace the loss or the layers' code, which no test runs under it."""
    if cp_size == 1:
        return
    problems = []
    fix = "or split sequences with DeepSpeed's Ulysses (accelerate_configs/ds_zero3_ulysses.yaml)"
    if not on_gpu and not ring_attention_runs_on_cpu():
        problems.append(f"Context parallelism (cp_size {cp_size}) on CPU: torch's ring attention runs CUDA's flash, "
                        f"memory-efficient or cuDNN attention only. Run it on GPUs, {fix}, which runs on CPU.")
    if on_gpu and recipe.mixed_precision == "no":
        problems.append(f"--mixed_precision no under context parallelism (cp_size {cp_size}): torch's ring attention "
                        "runs the flash, memory-efficient and cuDNN kernels, and fp32 attention over grouped "
                        "key/value heads may fall to SDPA's math kernel, which it does not dispatch. Use "
                        "--mixed_precision bf16.")
    if recipe.attn_implementation not in CONTEXT_ATTENTION:
        problems.append(f"--attn_implementation {recipe.attn_implementation} under context parallelism (cp_size "
                        f"{cp_size}): torch's ring attention replaces SDPA only. Use --attn_implementation sdpa, "
                        f"{fix}.")
    if recipe.packing:
        problems.append(f"--packing true under context parallelism (cp_size {cp_size}): the ring attention runs the "
                        "causal kernel over the whole row without a mask, so a packed row's sequences would attend "
                        "to each other. Use --packing false.")
    if recipe.max_seq_length % row_multiple(cp_size):
        multiple = row_multiple(cp_size)
        problems.append(f"--max_seq_length {recipe.max_seq_length} is not a multiple of 2 x cp_size = {multiple}: "
                        "torch's load balancing gives every rank two equal chunks of each row. Use a multiple of "
                        f"{multiple}.")
    unverified = [flag for flag, on in (("--use_liger_kernel", recipe.use_liger_kernel),
                                        ("--torch_compile", recipe.torch_compile),
                                        ("--mixed_precision fp8", recipe.mixed_precision == "fp8"),
                                        ("--method dpo", recipe.method == "dpo"),
                                        ("--activation_offloading", recipe.activation_offloading)) if on]
    if unverified:
        problems.append(f"{', '.join(unverified)} under context parallelism (cp_size {cp_size}): not run under the "
                        "split by any test here. Drop them, or split sequences with Ulysses.")
    if problems:
        raise ConfigError(problems)


def check_context_model(config: PretrainedConfig, cp_size: int) -> None:
    """A model with layers masked more strictly than causal (sliding-window or chunked attention) is refused: the
    ring attention drops the mask and runs full causal attention (accelerate's _attach_context_parallel_hooks
    refuses the same layers, read the same way, but only inside `prepare`, after loading)."""
    if cp_size == 1:
        return
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        stricter = sorted({kind for kind in layer_types if kind != "full_attention"})
    else:  # models before layer_types (Mistral) slide every layer's window whenever sliding_window is set
        stricter = ["sliding_attention"] if getattr(text, "sliding_window", None) else []
    if stricter:
        raise ConfigError(f"The model has {', '.join(stricter)} layers, which torch's ring attention (cp_size "
                          f"{cp_size}) would run as full causal attention: split its sequences with Ulysses "
                          "(accelerate_configs/ds_zero3_ulysses.yaml) instead.")


def checked_context_parallel(sizes: Mapping[str, int], world_size: int, uses_fsdp: bool, uses_deepspeed: bool
                             ) -> int:
    """The cp_size of the launch's parallelism_config `sizes` (accelerate's names), refused where accelerate or
    the trainer cannot run it: under DeepSpeed (accelerate's CP is FSDP2's), under DDP, beside the sequence split
    or tensor parallelism, or in groups that do not divide the processes."""
    cp, shard, replicate = sizes["cp"], sizes["dp_shard"], sizes["dp_replicate"]
    fix = ("launch accelerate_configs/fsdp_cp.yaml with --parallelism_config_cp_size <GPUs per sequence> "
           "--parallelism_config_dp_shard_size <processes / cp_size>")
    if uses_deepspeed:
        raise ConfigError(f"The accelerate config's parallelism_config sets cp_size {cp} under DeepSpeed: torch's "
                          "context parallelism runs under FSDP2 only; under DeepSpeed split sequences with Ulysses "
                          "(parallelism_config_sp_size, accelerate_configs/ds_zero3_ulysses.yaml).")
    if not uses_fsdp:
        raise ConfigError(f"The accelerate config's parallelism_config sets cp_size {cp} without FSDP: accelerate "
                          f"runs context parallelism under FSDP2 only: {fix}.")
    if sizes["tp"] != 1 or sizes["sp"] != 1:
        raise ConfigError(f"The accelerate config's parallelism_config sets cp_size {cp} beside tp_size "
                          f"{sizes['tp']} and sp_size {sizes['sp']}: context parallelism composes with neither here; "
                          "keep one of them.")
    if replicate * shard * cp != world_size:
        raise ConfigError(f"parallelism_config dp_replicate_size {replicate} x dp_shard_size {shard} x cp_size {cp} "
                          f"is not the {world_size} processes launched: {fix}.")
    return cp


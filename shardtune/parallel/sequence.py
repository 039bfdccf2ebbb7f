"""The sequence split: every sequence of a micro-batch cut along its length over sp ranks, through DeepSpeed's
Ulysses as accelerate wires it. accelerate's `prepare` registers DeepSpeed's UlyssesSPAttentionHF in place of the
model's attention kernel: an all-to-all gives each rank the whole sequence for 1/sp of the heads, a second one
returns its slice. Activations, logits and the loss's tiles are 1/sp per rank; the weights are ZeRO's.

How the trainer drives it:
- Data. Every rank loads its own rows, as without the split. Each optimizer step's micro-batches of a group of sp
  ranks are exchanged by DeepSpeed's UlyssesSPDataLoaderAdapter, so that each rank runs its slice of every one of
  them: sp x accumulation forward-backward passes of 1/sp of the length. A step still covers micro x
  accumulation x world rows (the global batch), and each token runs on exactly one rank.
- Loss. Each slice's target tokens over the global batch's target count, with the labels shifted before the
  sequence is cut (the adapter's `shift_labels`): summed over the ranks, the global batch's token mean, each
  token counted once; logged loss, token counts and tokens/s come from each rank's own rows, as without the split.
- Gradients. The engine runs sp x accumulation micro-steps (its gradient_accumulation_steps) and divides the loss
  by their count; it sums the gradients over every rank and divides by what its reduction path divides by: ZeRO-1/2
  by world / sp (stage_1_and_2.py), ZeRO-3's reduce-scatter by world (stage3.py __avg_scatter_grads through
  reduce_scatter_coalesced, which knows no split; its contiguous path, taken without reduce_scatter for buckets
  under reduce_bucket_size only, divides by world / sp, so that mixture is refused). The step scales the loss by
  exactly these (SequenceSplit.reduction_factor): never 2x, whichever stage.
- Masks. Ulysses drops the attention mask: a right-padded row is exact under the causal kernel (the padding comes
  after every real token); a packed row would attend across its sequences, except under flash attention, which
  reads the boundaries from the position ids: packing is refused otherwise.
- Eval runs split as training does (shardtune.evaluation.split_statistics). accelerate registers Ulysses with
  disable_in_eval, which the trainer turns off (split_in_eval); generation runs without the split (each rank the
  same prompts, whole), one prompt at a time (left padding would need the mask), each prompt cut to its last
  max_seq_length / sp tokens, the length a GPU holds of a training row.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardtune.config import ConfigError, Recipe

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# The kernels Ulysses runs (accelerate's DeepSpeedSequenceParallelConfig): eager needs a dense mask of the whole
# sequence and flex a block mask, both refused there.
ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
# Those that honour the position ids of a packed row once the mask is dropped.
POSITION_AWARE_ATTENTION = ("flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class SequenceSplit:
    """A launch's sequence split as the step needs it."""

    # DeepSpeed divides the gradients summed over the ranks by world / sp times this: sp under ZeRO-3 (its
    # reduce-scatter averages over every rank), 1 under ZeRO-1/2.
    reduction_factor: int


def split_size(accelerator: Accelerator) -> int:
    """The ranks each sequence is split over in a prepared run (1 without a split)."""
    config = accelerator.parallelism_config
    return config.sp_size if config is not None and config.sp_enabled else 1


def sequence_split(sp_size: int, deepspeed_settings: Mapping[str, Any]) -> SequenceSplit | None:
    """The launch's split (None without one), from its DeepSpeed settings (plan.strategy.deepspeed_settings)."""
    if sp_size == 1:
        return None
    return SequenceSplit(sp_size if str(deepspeed_settings.get("stage")) == "3" else 1)


def ulysses_parallelism(recipe: Recipe, world_size: int, sp_size: int) -> ParallelismConfig:
    """accelerate's ParallelismConfig for the split: the recipe's attention kernel (accelerate refuses one that
    differs from the model's), rows of any length (a multiple of sp: the collator pads to it), and the data-parallel
    size world / sp, by which accelerate sizes DeepSpeed's train_batch_size."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                              sp_attn_implementation=recipe.attn_implementation)
    return ParallelismConfig(dp_replicate_size=world_size // sp_size, dp_shard_size=1, tp_size=1, cp_size=1,
                             sp_size=sp_size, sp_backend="deepspeed", sp_handler=handler)


def sequence_shards(micro_batches: list[dict], device: torch.device) -> list[dict]:
    """This rank's slices of the step's micro-batches of its whole group, in DeepSpeed's order (the group's first
    rank's micro-batch first): `input_ids`, `position_ids` and the other tensors cut along the length, `labels`
    replaced by `shift_labels`, each token's next-token label shifted before the cut. The micro-batches are first
    padded to the longest of the group's (DeepSpeed's exchange, UlyssesSPDataLoaderAdapter, gathers them whole,
    and gloo gathers equal shapes only): one gather of their lengths, read on the host (a device sync per step),
    and the adapter reads each micro-batch's length on the host again (a sync per micro-batch)."""
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups

    group, size = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_world_size()
    lengths = torch.tensor([batch["input_ids"].shape[1] for batch in micro_batches], device=device)
    gathered = [torch.empty_like(lengths) for _ in range(size)]
    dist.all_gather(gathered, lengths, group=group)
    longest = int(torch.stack(gathered).max())  # a device-to-host sync
    padded = [padded_to(batch, longest) for batch in micro_batches]
    fit_rows(padded[0]["input_ids"].shape[0])  # every micro-batch of a step has as many rows
    adapter = UlyssesSPDataLoaderAdapter(padded, sp_rank=groups._get_sequence_parallel_rank(), sp_group=group,
                                         sp_world_size=size, device=device)
    # The adapter leaves the slices on the host (its prefill buffer); the model's device takes them.
    return [{key: value.to(device) if torch.is_tensor(value) else value for key, value in shard.items()}
            for shard in adapter]


def sequence_group() -> tuple[object, int]:
    """(this rank's sequence-parallel process group, its rank in it): DeepSpeed's, made when accelerate prepared
    the model."""
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()


def padded_to(batch: dict, length: int) -> dict:
    """`batch` with every (rows, positions) tensor padded on the right to `length` positions: padding that carries
    no loss and that no real token attends to (it comes after them, under a causal kernel). Its positions go on
    from the row's last: positions that restart would make transformers take the row for a packed one and build a
    dense mask of the slice, which Ulysses then drops."""
    import torch
    import torch.nn.functional as F

    from shardtune.data.tokenize import IGNORE_INDEX

    missing = length - batch["input_ids"].shape[1]
    if missing == 0:
        return batch
    padded = {}
    for key, value in batch.items():
        if key == "position_ids":
            tail = value[:, -1:] + 1 + torch.arange(missing, device=value.device, dtype=value.dtype)
            padded[key] = torch.cat([value, tail], dim=1)
        elif torch.is_tensor(value) and value.dim() == 2:
            padded[key] = F.pad(value, (0, missing), value=IGNORE_INDEX if key == "labels" else 0)
        else:
            padded[key] = value
    return padded


def ulysses_attention():
    """DeepSpeed's UlyssesSPAttentionHF that accelerate's `prepare` registered in place of the model's attention
    kernel (the entry of transformers' ALL_ATTENTION_FUNCTIONS for that kernel is then DeepSpeed's wrapper around
    it): accelerate keeps no handle on it."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in ALL_ATTENTION_FUNCTIONS.valid_keys():
        for cell in getattr(ALL_ATTENTION_FUNCTIONS[name], "__closure__", None) or ():
            if isinstance(cell.cell_contents, UlyssesSPAttentionHF):
                return cell.cell_contents
    raise RuntimeError("accelerate registered no Ulysses attention: the DeepSpeed or accelerate version changed how "
                       "the sequence split is wired (shardtune.parallel.sequence).")


def fit_rows(rows: int) -> None:
    """Ulysses' attention for batches of `rows` rows. accelerate registers it for one row count, the smaller of the
    training and eval batches (accelerator.py `_prepare_deepspeed`), and it checks every forward's shapes and
    reshapes by that count: a packed micro-batch (one row) or an eval batch of another size would fail its
    asserts. Its other dimensions follow each forward's length (seq_length_is_variable)."""
    import torch

    attention = ulysses_attention()
    if attention.batch_size == rows:
        return
    attention.batch_size = rows
    for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
        shape = list(getattr(attention, name))
        shape[1] = rows  # [positions, rows, heads, head_dim] / [positions, rows, hidden / sp]
        setattr(attention, name, torch.Size(shape))


def split_in_eval() -> None:
    """Run the eval forward split too: accelerate registers Ulysses with disable_in_eval, under which an eval
    forward would attend over its own slice only."""
    ulysses_attention().disable_in_eval = False


@contextmanager
def unsplit(split: bool) -> Iterator[None]:
    """The eval forward without the split inside (generation: every rank runs the same whole prompts); `split`
    False: no split to pause."""
    if not split:
        yield
        return
    attention = ulysses_attention()
    attention.disable_in_eval = True
    try:
        yield
    finally:
        attention.disable_in_eval = False


def plain_loader(loader):
    """The DataLoader accelerate's `prepare` wrapped in DeepSpeed's adapter under the split: the trainer cuts each
    step's micro-batches itself (sequence_shards) and evaluates without the split."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    return loader.dl if isinstance(loader, UlyssesSPDataLoaderAdapter) else loader


def check_right_padding(tokenizer: PreTrainedTokenizerBase) -> None:
    """Padded rows under the split carry no mask: the padding must come after the real tokens."""
    if tokenizer.padding_side != "right":
        raise ConfigError(f"The tokenizer pads on the {tokenizer.padding_side}, and under the sequence split rows "
                          "carry no attention mask (Ulysses and the ring attention take none): set "
                          "\"padding_side\": \"right\" in the model's tokenizer_config.json.")


def check_sequence_split(recipe: Recipe, sp_size: int, deepspeed_settings: Mapping[str, Any]) -> None:
    """What the split needs of the recipe and of DeepSpeed: a kernel Ulysses runs, no packing where the dropped mask
    would let sequences attend to each other, a length the split divides, the recipe's kernel in accelerate's place,
    and one gradient division for every bucket under ZeRO-3."""
    if sp_size == 1:
        return
    import os

    problems = []
    if str(deepspeed_settings.get("stage")) == "3" and not deepspeed_settings.get("reduce_scatter", True):
        problems.append("ZeRO-3 with reduce_scatter false under the sequence split: DeepSpeed then divides a "
                        "gradient bucket by the data-parallel ranks or by all ranks depending on its size, so the "
                        "gradients would be off by sp_size in some buckets. Remove reduce_scatter from the "
                        "DeepSpeed JSON (its default is true).")
    attention = recipe.attn_implementation
    if attention not in ULYSSES_ATTENTION:
        problems.append(f"--attn_implementation {attention} cannot run under the sequence split (sp_size {sp_size}): "
                        f"Ulysses takes {', '.join(ULYSSES_ATTENTION)}; use sdpa, or flash_attention_2 on GPUs.")
    elif recipe.packing and attention not in POSITION_AWARE_ATTENTION:
        problems.append(f"--packing true under the sequence split with --attn_implementation {attention}: Ulysses "
                        "drops the attention mask, so the sequences of a packed row would attend to each other. "
                        "Use --attn_implementation flash_attention_2 (it reads the boundaries from the position "
                        "ids), or --packing false.")
    if recipe.max_seq_length % sp_size:
        problems.append(f"--max_seq_length {recipe.max_seq_length} is not a multiple of sp_size {sp_size}: every "
                        f"rank takes an equal slice of each sequence. Use a multiple of {sp_size}.")
    # accelerate launch exports its own default, sdpa, where neither the config nor its command line sets one
    # (the shipped YAMLs set none): only another value was asked for.
    configured = os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "").strip()
    if configured not in ("", "None", "sdpa", attention):
        problems.append(f"parallelism_config_sp_attn_implementation {configured} (in the accelerate config's "
                        f"parallelism_config section, or given to accelerate launch) differs from "
                        f"--attn_implementation {attention}: remove it (the run gives Ulysses the recipe's kernel), "
                        f"or give the recipe --attn_implementation {configured}.")
    if problems:
        raise ConfigError(problems)


def check_split_heads(config: PretrainedConfig, sp_size: int) -> None:
    """Ulysses gives each rank 1/sp of the attention heads: sp must divide them, and divide the key/value heads or
    be a multiple of them (each then replicated sp / kv times)."""
    if sp_size == 1:
        return
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % sp_size:
        raise ConfigError(f"The model has {heads} attention heads, which sp_size {sp_size} does not divide: Ulysses "
                          "gives each rank an equal share of them. Set parallelism_config_sp_size to a divisor of "
                          f"{heads}.")
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ConfigError(f"The model has {kv_heads} key/value heads, and sp_size {sp_size} neither divides them "
                          "nor is a multiple of them: set parallelism_config_sp_size to one that does.")

"""The ranks that run the same rows: a tensor-parallel group (every rank the same loss) and a context-parallel group
(every rank its own positions of them). What enters the sums over ranks once per group: the rows' counts and eval
statistics, and under TP the loss (shardtune.parallel.tensor, shardtune.parallel.context)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtune.parallel.context import context_parallel_rank, context_parallel_size
from shardtune.parallel.tensor import tensor_parallel_size

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator


def counted_here(accelerator: Accelerator) -> bool:
    """Whether this rank's rows enter the sums over ranks (their counts and eval statistics): the first rank of its
    tensor- and context-parallel group (every rank without either). The other ranks of the group ran the same
    rows."""
    return loss_counted_here(accelerator) and context_parallel_rank(accelerator) == 0


def loss_counted_here(accelerator: Accelerator) -> bool:
    """Whether this rank's loss share enters the sum over ranks: every rank of a context-parallel group holds its
    own positions; of a tensor-parallel group only the first (they all compute the same loss)."""
    return tensor_parallel_size(accelerator) == 1 or accelerator.tensor_parallel_rank == 0


def rows_once(accelerator: Accelerator, per_row: torch.Tensor) -> torch.Tensor:
    """gather_for_metrics of `per_row` with each group's rows once: the rows of its first rank, in data-rank order,
    the padding of the last batch dropped (accelerate's gather_for_metrics would keep a copy of every row per rank
    of the group and cut the last batch at the wrong place)."""
    size = tensor_parallel_size(accelerator) * context_parallel_size(accelerator)
    if size == 1:
        return accelerator.gather_for_metrics(per_row)
    gathered = accelerator.gather(per_row).view(-1, *per_row.shape)[::size].flatten(0, 1)
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        gathered = gathered[:state.remainder]
    return gathered

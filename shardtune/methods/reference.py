"""DPO's reference model, held one of three ways (shardtune.config.REFERENCE_MODES), named in the start-up line:
- `adapter`: under --use_peft, the policy itself with its LoRA adapter switched off (peft's disable_adapter): no
  second model.
- `precomputed` (--precompute_ref_log_probs): the reference's log-probs of every train and eval pair in one pass
  before the first step, in eval mode, by --ref_model_name_or_path (loaded for the pass only), else by the policy
  as loaded (the reference, before it trains; under LoRA with its adapter off); kept in the output dir with what
  they were computed from (REFERENCE_CACHE), so that a resumed run reads them instead of computing them again, and
  a run of another model or data computes them anew.
- `live`: a frozen copy of --ref_model_name_or_path (default: the policy's model) in the compute dtype, sharded
  exactly as the policy under FSDP2 (accelerate's fully_shard per decoder layer) and ZeRO-3 (an engine of its
  own, stage 3, gathered layer by layer); a whole copy on every GPU under DDP and ZeRO-1/2 (stage 0, as TRL),
  which the planner counts in full.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from datasets import Dataset

from shardtune.checkpoint.durable import durable
from shardtune.config import Recipe, compute_precision

REFERENCE_CACHE = "reference_log_probs"  # under the output dir: <split>.pt and <split>.json (what it was made of)


def describe_reference(recipe: Recipe) -> str:
    """The reference as the start-up line names it."""
    mode = recipe.reference_mode
    if mode == "adapter":
        return "reference: the base, adapter off"
    if mode == "precomputed":
        return "reference: log-probs precomputed"
    return f"reference: a frozen copy of {recipe.ref_model_name_or_path or recipe.model_name_or_path}"


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode with no parameter that trains and no dropout (TRL's disable_dropout)."""
    model.requires_grad_(False)
    disable_dropout(model)
    return model.eval()


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout off (TRL's DPOConfig disable_dropout, its default): a dropout in the policy's forward, LoRA's
    included, would make its log-probs differ from the reference's before any step."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def load_reference(accelerator: Accelerator, recipe: Recipe) -> torch.nn.Module:
    """The live reference, loaded as the policy is (rank 0 alone under FSDP's RAM-efficient loading; partitioned
    while it loads under ZeRO-3) in the compute dtype, frozen, and prepared like the policy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.model import fsdp_loads_on_rank0

    path = recipe.ref_model_name_or_path or recipe.model_name_or_path
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compute_precision(recipe.mixed_precision),
                                                               torch.float32)
    if not accelerator.is_main_process and fsdp_loads_on_rank0():
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype,
                                                     attn_implementation=recipe.attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=recipe.attn_implementation)
    model.config.use_cache = False
    return prepare_reference(accelerator, frozen(model))


def prepare_reference(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The frozen reference placed as the policy's strategy places it, registered nowhere: accelerate's checkpoint
    (save_state) holds the policy alone."""
    if accelerator.distributed_type == DistributedType.FSDP:
        from accelerate.utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, model)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed

        # As TRL's prepare_deepspeed: no optimizer, scheduler or optimizer offload; ZeRO-3 partitions the reference
        # like the policy, ZeRO-1/2 (which partition no weights) hold it whole (stage 0).
        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        if config["zero_optimization"].get("stage") != 3:
            config["zero_optimization"]["stage"] = 0
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeed's returns None
        return engine
    return model.to(accelerator.device)


def reference_log_probs(accelerator: Accelerator, recipe: Recipe, policy: torch.nn.Module,
                        reference: torch.nn.Module | None, tile: int | None) -> Callable[[dict], torch.Tensor]:
    """A preference batch's reference log-probs per sequence (chosen rows, then rejected): the live `reference`'s,
    or (adapter mode) the policy's with its adapter off."""
    from shardtune.methods.dpo import sequence_log_probs

    if reference is not None:
        unwrapped = reference.module if hasattr(reference, "module") else reference

        def of_live(batch: dict) -> torch.Tensor:
            with accelerator.autocast():
                return sequence_log_probs(reference, unwrapped, batch, tile)

        return of_live
    peft_model = accelerator.unwrap_model(policy)

    def of_base(batch: dict) -> torch.Tensor:
        with peft_model.disable_adapter():
            return sequence_log_probs(policy, peft_model, batch, tile)

    return of_base


# ---------------------------------------------------------------------------------------------------------------
# Precomputed log-probs.


def cache_key(recipe: Recipe, dataset: Dataset) -> dict:
    """What a split's reference log-probs depend on: the reference's weights (their files' names, sizes and times),
    the pairs (datasets' fingerprint of the tokenized split), their cut and the precision."""
    path = recipe.ref_model_name_or_path or recipe.model_name_or_path
    files = {}
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith((".safetensors", ".bin", ".json")):
                stat = os.stat(os.path.join(path, name))
                files[name] = [stat.st_size, stat.st_mtime_ns]
    return {"model": os.path.abspath(path) if os.path.isdir(path) else path, "files": files,
            "use_peft": recipe.use_peft, "data": dataset._fingerprint, "pairs": len(dataset),
            "max_seq_length": recipe.max_seq_length, "mixed_precision": recipe.mixed_precision,
            "attn_implementation": recipe.attn_implementation}


def read_cache(output_dir: str, split: str, key: dict) -> torch.Tensor | None:
    """The split's cached (pairs, 2) log-probs if they were computed from `key`, else None."""
    base = os.path.join(output_dir, REFERENCE_CACHE, split)
    try:
        with open(f"{base}.json", encoding="utf-8") as file:
            if json.load(file) != key:
                return None
        return torch.load(f"{base}.pt", weights_only=True)
    except (OSError, ValueError, RuntimeError):
        return None


def write_cache(output_dir: str, split: str, key: dict, table: torch.Tensor) -> None:
    """The table, then what it was made of: each file written aside, fsynced and renamed, the key last, so that a
    key on disk always names a complete table."""
    directory = os.path.join(output_dir, REFERENCE_CACHE)
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, split)
    torch.save(table, f"{base}.pt.tmp")
    durable(f"{base}.pt.tmp")
    os.replace(f"{base}.pt.tmp", f"{base}.pt")
    with open(f"{base}.json.tmp", "w", encoding="utf-8") as file:
        json.dump(key, file)
    durable(f"{base}.json.tmp")
    os.replace(f"{base}.json.tmp", f"{base}.json")
    durable(directory, recursive=False)


@torch.no_grad()
def compute_table(accelerator: Accelerator, model: torch.nn.Module, dataset: Dataset, collate, batch_size: int,
                  reference: Callable[[dict], torch.Tensor] | None, tile: int | None) -> torch.Tensor:
    """Every pair's (chosen, rejected) reference log-probs, (pairs, 2) fp32 on the host, the same on every rank:
    each rank runs an equal share of the batches (the last padded with the split's first pairs: every forward of a
    sharded model is a collective), and an all-gather joins them."""
    from shardtune.data.batches import COUNTS
    from shardtune.methods.dpo import sequence_log_probs

    ranks, rank = accelerator.num_processes, accelerator.process_index
    per_rank = -(-len(dataset) // (ranks * batch_size)) * batch_size
    order = [index % len(dataset) for index in range(rank * per_rank, (rank + 1) * per_rank)]
    unwrapped = accelerator.unwrap_model(model)
    was_training = model.training
    model.eval()
    tables = []
    for start in range(0, per_rank, batch_size):
        batch = collate([dataset[index] for index in order[start:start + batch_size]])
        batch.pop(COUNTS)
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        logps = reference(batch) if reference is not None else sequence_log_probs(model, unwrapped, batch, tile)
        tables.append(torch.stack(logps.float().chunk(2), dim=1))
    model.train(was_training)
    gathered = accelerator.gather(torch.cat(tables))  # rank 0's rows, then rank 1's, ...
    return gathered[: len(dataset)].cpu()


def precomputed_table(accelerator: Accelerator, recipe: Recipe, model: torch.nn.Module, dataset: Dataset, split: str,
                      collate, batch_size: int, reference, tile: int | None) -> tuple[torch.Tensor, bool]:
    """The split's reference log-probs, read from the output dir's cache when they were computed from this model
    and data, else computed and cached. Runs before any checkpoint loads (shardtune.trainer.start): the policy is
    still as loaded, the reference. Returns the table and whether it was read."""
    key = cache_key(recipe, dataset)
    # every rank reads the main process's verdict: the computation is a collective
    cached = read_cache(recipe.resolved_output_dir, split, key) if accelerator.is_main_process else None
    found = [cached is not None]
    broadcast_object_list(found)
    if found[0]:
        return (cached if cached is not None else read_cache(recipe.resolved_output_dir, split, key)), True
    table = compute_table(accelerator, model, dataset, collate, batch_size, reference, tile)
    if accelerator.is_main_process:
        write_cache(recipe.resolved_output_dir, split, key, table)
    accelerator.wait_for_everyone()
    return table, False

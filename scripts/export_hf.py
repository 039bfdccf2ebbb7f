"""Export a training checkpoint to a Hugging Face model directory (safetensors, sharded above 5 GB).

    python scripts/export_hf.py outputs/llama8b/checkpoint-1000 exported/llama8b-step1000

Works on any checkpoint the trainer writes: DDP / single process (model.safetensors), FSDP sharded state
(torch.distributed.checkpoint), and DeepSpeed ZeRO partitions (DeepSpeed's zero_to_fp32, fp32 master weights),
with or without --save_only_model. FSDP and ZeRO checkpoints are converted shard by shard: at most one output
shard is held in memory. A checkpoint that does not match its marker (a file missing or cut short) is refused.
The export is written under a temporary name, fsynced, then renamed: it appears whole or not at all.

The weights are written in the dtype the checkpoint's config.json states (the trainer writes there the run's
--save_dtype: by default the model's own, bf16 for the Llama recipes), cast shard by shard; `--dtype fp32` (or
bf16, fp16) asks for another. The config.json written states the dtype of the weights written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardtune.checkpoint.durable import durable, fsync_path
from shardtune.checkpoint.markers import MARKER, damage
from shardtune.export import EXPORT_DTYPES, cast_floating

MAX_SHARD_SIZE = "5GB"
DCP_PREFIX = "model."  # accelerate's save_fsdp_model nests the model state under "model"
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


def stated_dtype(checkpoint: Path) -> torch.dtype | None:
    """The dtype the checkpoint's config.json states; None where it states none (the weights stay as stored)."""
    config = checkpoint / "config.json"
    name = json.loads(config.read_text()).get("dtype") if config.is_file() else None
    return getattr(torch, name) if isinstance(name, str) and name else None


def export(checkpoint: Path, output: Path, dtype: torch.dtype | None = None) -> None:
    """Write `checkpoint`'s model as a Hugging Face model directory in `dtype` (None: as stored)."""
    fsdp_state = checkpoint / "pytorch_model_fsdp_0"
    if (checkpoint / "model.safetensors").is_file():
        export_single(checkpoint / "model.safetensors", output / "model.safetensors", dtype)
    elif fsdp_state.is_dir():
        export_fsdp(fsdp_state, output, dtype)
    elif (checkpoint / "pytorch_model" / "offloaded_tensors").is_dir():
        export_zero_nvme(checkpoint / "pytorch_model", output, dtype)
    elif (checkpoint / "pytorch_model").is_dir():
        # DeepSpeed takes seconds to import and only ZeRO checkpoints need it.
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

        # The fp32 master weights, assembled from the ZeRO partitions and cast shard by shard.
        convert_zero_checkpoint_to_state_dict(
            str(checkpoint), str(output), dtype=dtype or torch.float32, tag="pytorch_model",
            safe_serialization=True, max_shard_size=MAX_SHARD_SIZE,
        )
    else:
        raise SystemExit(f"export_hf: error: {checkpoint} holds no model state this script knows "
                         "(model.safetensors, pytorch_model_fsdp_0/ or DeepSpeed's pytorch_model/).")
    for name in MODEL_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, output / name)
    write_config_dtype(output, written_dtype(output))


def export_zero_nvme(ds_dir: Path, output: Path, dtype: torch.dtype | None) -> None:
    """A ZeRO-3 checkpoint of a run whose optimizer was on NVMe: DeepSpeed saves the swapped sub-groups' fp32
    master weights as empty tensors in optim_states.pt and their data in offloaded_tensors/ (the swap files), so
    zero_to_fp32 alone fails on the element count. The swap files fill the empty sub-groups, then zero_to_fp32
    assembles the parameters, written one output shard at a time."""
    from deepspeed.utils import zero_to_fp32

    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(ds_dir)))
    optim_files = zero_to_fp32.get_optim_files(str(ds_dir))
    world = len(optim_files)
    flat_groups = [nvme_filled_flat_groups(Path(path), ds_dir / "offloaded_tensors" / f"rank{rank:02d}",
                                           model_states[rank].param_shapes, world)
                   for rank, path in enumerate(optim_files)]
    state = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, False)
    empty = zero_to_fp32.to_torch_tensor(state, return_empty_tensor=True, dtype=dtype or torch.float32)
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    for filename, keys in split.filename_to_tensors.items():
        shard = zero_to_fp32.to_torch_tensor({key: state.pop(key) for key in keys}, dtype=dtype or torch.float32)
        save_file(shard, str(output / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def nvme_filled_flat_groups(optim_file: Path, swap_dir: Path, sub_group_shapes: list[dict],
                            world: int) -> list[torch.Tensor]:
    """One rank's fp32 master partitions, one flat tensor per optimizer sub-group, the swapped ones read from
    their swap files. A sub-group's partition holds ceil(numel / world) elements of each of its parameters
    (`sub_group_shapes`: the model states' param_shapes, one dict per sub-group); a swap file is that, padded to
    DeepSpeed's I/O alignment. The swap files are named <first ds_id>_<last ds_id>: in id order within each
    optimizer param group, so each goes to the next swapped sub-group of the group whose size it fits."""
    saved = torch.load(optim_file, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
    flat = list(saved["fp32_flat_groups"])
    lengths = [sum(math.ceil(shape.numel() / world) for shape in shapes.values()) for shapes in sub_group_shapes]
    waiting = [[index for index in group["params"] if flat[index].numel() != lengths[index]]
               for group in saved["optimizer_state_dict"]["param_groups"]]
    files = [path for path in swap_dir.glob("*.tensor.swp") if re.fullmatch(r"\d+_\d+\.tensor\.swp", path.name)]
    files.sort(key=lambda path: int(path.name.split("_")[0]))  # the Adam moments' files are named exp_avg-…
    for path in files:
        elements = path.stat().st_size // 4
        fits = [queue for queue in waiting if queue and lengths[queue[0]] <= elements < lengths[queue[0]] + 4096]
        if len(fits) != 1:
            raise SystemExit(f"export_hf: error: {path} matches {len(fits)} of the checkpoint's swapped optimizer "
                             "sub-groups; export the run's own model.safetensors instead.")
        index = fits[0].pop(0)
        flat[index] = torch.from_file(str(path), size=elements, dtype=torch.float32)[:lengths[index]]
    missing = [index for queue in waiting for index in queue]
    if missing:
        raise SystemExit(f"export_hf: error: {swap_dir} lacks the swap files of optimizer sub-groups {missing}.")
    return flat


def export_single(source: Path, target: Path, dtype: torch.dtype | None) -> None:
    """A DDP / single-process checkpoint's one safetensors file, cast (or copied as it is)."""
    if dtype is None:
        shutil.copy2(source, target)
    else:
        save_file(cast_floating(load_file(str(source)), dtype), str(target), metadata={"format": "pt"})


def written_dtype(output: Path) -> torch.dtype | None:
    """The floating-point dtype of the weights in the export (read from the safetensors headers)."""
    for path in sorted(output.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sliced = file.get_slice(key)
                dtype = getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32",
                                        "F64": "float64"}.get(sliced.get_dtype(), ""), None)
                if dtype is not None:
                    return dtype
    return None


def write_config_dtype(output: Path, dtype: torch.dtype | None) -> None:
    """config.json states the dtype of the weights beside it."""
    config = output / "config.json"
    if dtype is None or not config.is_file():
        return
    values = json.loads(config.read_text())
    values["dtype"] = str(dtype).removeprefix("torch.")
    config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def export_fsdp(state_dir: Path, output: Path, dtype: torch.dtype | None = None) -> None:
    """Read a torch.distributed.checkpoint model state one output shard at a time, cast to `dtype`."""
    metadata = dcp.FileSystemReader(str(state_dir)).read_metadata()
    shapes = {key: meta for key, meta in metadata.state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata)}
    empty = {key: torch.empty(meta.size, dtype=out_dtype(meta.properties.dtype, dtype), device="meta")
             for key, meta in shapes.items()}  # shards sized as written
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    for filename, keys in split.filename_to_tensors.items():
        shard = {key: torch.empty(shapes[key].size, dtype=shapes[key].properties.dtype) for key in keys}
        dcp.load(shard, storage_reader=dcp.FileSystemReader(str(state_dir)), no_dist=True)
        save_file(hf_names(cast_floating(shard, dtype)), str(output / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": hf_names(split.tensor_to_filename)}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def hf_names(values: dict) -> dict:
    """The model's own parameter names: accelerate saves the FSDP state as {"model": state_dict}, so every
    key in the checkpoint starts with "model."."""
    return {key.removeprefix(DCP_PREFIX): value for key, value in values.items()}


def out_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and stored.is_floating_point else stored


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-<step> directory")
    parser.add_argument("output", type=Path, help="new directory for the Hugging Face model")
    parser.add_argument("--dtype", choices=["auto", *EXPORT_DTYPES], default="auto",
                        help="dtype of the weights written; auto: the one the checkpoint's config.json states (the "
                             "run's --save_dtype, by default the model's own)")
    args = parser.parse_args(argv)
    if not (args.checkpoint / MARKER).is_file():
        sys.exit(f"export_hf: error: {args.checkpoint} is not a complete checkpoint (no {MARKER}).")
    problem = damage(str(args.checkpoint))
    if problem:
        sys.exit(f"export_hf: error: {args.checkpoint} is damaged: {problem}. Export an earlier checkpoint.")
    if args.output.exists() and any(args.output.iterdir()):
        sys.exit(f"export_hf: error: {args.output} is not empty; give a new directory.")
    scratch = args.output.with_name(f".{args.output.name}.tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    dtype = stated_dtype(args.checkpoint) if args.dtype == "auto" else EXPORT_DTYPES[args.dtype]
    export(args.checkpoint, scratch, dtype)
    durable(str(scratch))  # every file on disk before the output takes its name: a crash leaves no half model
    if args.output.exists():
        args.output.rmdir()
    os.rename(scratch, args.output)  # the output appears only when complete
    fsync_path(str(args.output.parent))  # and the rename survives a crash too
    print(f"export_hf: wrote {args.output}")


if __name__ == "__main__":
    main()

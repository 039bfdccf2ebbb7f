"""Export a training checkpoint to a Hugging Face model directory (safetensors, sharded above 5 GB).

    python scripts/export_hf.py outputs/llama8b/checkpoint-1000 exported/llama8b-step1000

Works on any checkpoint the trainer writes: DDP / single process (model.safetensors), FSDP sharded state
(torch.distributed.checkpoint), and DeepSpeed ZeRO partitions (DeepSpeed's zero_to_fp32, fp32 master weights),
with or without --save_only_model. FSDP and ZeRO checkpoints are converted shard by shard: at most one output
shard is held in memory. A checkpoint that does not match its marker (a file missing or cut short) is refused.
The export is written under a temporary name, fsynced, then renamed: it appears whole or not at all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from shardtune.checkpoint import MARKER, damage, durable, fsync_path

MAX_SHARD_SIZE = "5GB"
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


def export(checkpoint: Path, output: Path) -> None:
    fsdp_state = checkpoint / "pytorch_model_fsdp_0"
    if (checkpoint / "model.safetensors").is_file():
        shutil.copy2(checkpoint / "model.safetensors", output / "model.safetensors")
    elif fsdp_state.is_dir():
        export_fsdp(fsdp_state, output)
    elif (checkpoint / "pytorch_model").is_dir():
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(
            str(checkpoint), str(output), tag="pytorch_model", safe_serialization=True, max_shard_size=MAX_SHARD_SIZE
        )
    else:
        raise SystemExit(f"export_hf: error: {checkpoint} holds no model state this script knows "
                         "(model.safetensors, pytorch_model_fsdp_0/ or DeepSpeed's pytorch_model/).")
    for name in MODEL_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, output / name)


def export_fsdp(state_dir: Path, output: Path) -> None:
    """Read a torch.distributed.checkpoint model state one output shard at a time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(state_dir)).read_metadata()
    shapes = {key: meta for key, meta in metadata.state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata)}
    empty = {key: torch.empty(meta.size, dtype=meta.properties.dtype, device="meta") for key, meta in shapes.items()}
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=MAX_SHARD_SIZE)
    for filename, keys in split.filename_to_tensors.items():
        shard = {key: torch.empty(shapes[key].size, dtype=shapes[key].properties.dtype) for key in keys}
        dcp.load(shard, storage_reader=dcp.FileSystemReader(str(state_dir)), no_dist=True)
        save_file(shard, str(output / filename), metadata={"format": "pt"})
    if split.is_sharded:
        import json

        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-<step> directory")
    parser.add_argument("output", type=Path, help="new directory for the Hugging Face model")
    args = parser.parse_args()
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
    export(args.checkpoint, scratch)
    durable(str(scratch))  # every file on disk before the output takes its name: a crash leaves no half model
    if args.output.exists():
        args.output.rmdir()
    os.rename(scratch, args.output)  # the output appears only when complete
    fsync_path(str(args.output.parent))  # and the rename survives a crash too
    print(f"export_hf: wrote {args.output}")


if __name__ == "__main__":
    main()

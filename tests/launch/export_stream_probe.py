"""Launched by tests/launch/test_export_stream.py under `accelerate launch` with a recipe's flags: the model built
and prepared as the trainer builds it, then written twice with the same small max_shard_size: by shardtune.export.model
(streamed, one shard at a time) and as the export was written before it streamed (accelerate's get_state_dict
gathers the whole model to the main process, save_pretrained writes it). The main process prints one JSON line:
each export's files, whether their bytes are equal, and its peak resident set size above the size before."""

from __future__ import annotations

import json
import os

from shardtune.cli import checked_launch, startup_heap_frozen

with startup_heap_frozen():  # the imports as a recipe's launch makes them (shardtune.cli.main)
    from shardtune.config import Recipe
    from shardtune.export.model import cast_floating, save_hf_model
    from shardtune.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    from shardtune.parallel.distributed import make_accelerator, shut_down
    from shardtune.trainer import build

SHARD_BYTES = 4_000_000


def whole_model_export(accelerator, model, output_dir: str, dtype) -> None:
    """The export as written before it streamed: the whole state dict on the main process, then save_pretrained."""
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        for tied in unwrapped.all_tied_weights_keys:
            state_dict.pop(tied, None)
        unwrapped.save_pretrained(output_dir, state_dict=cast_floating(state_dict, dtype), safe_serialization=True,
                                  max_shard_size=SHARD_BYTES)
    del state_dict
    accelerator.wait_for_everyone()


def measured(export) -> int:
    reset_peak_rss()
    before = rss_bytes()
    export()
    return peak_rss_bytes() - before


def files(directory: str) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))
            if name.startswith("model")}


def load_sharded(directory: str) -> dict:
    from safetensors.torch import load_file

    return {key: value for name in os.listdir(directory) if name.endswith(".safetensors")
            for key, value in load_file(os.path.join(directory, name)).items()}


def main() -> None:
    recipe, launch, batching = checked_launch(Recipe(name="tiny", max_seq_length=64), None)
    accelerator = make_accelerator(recipe, batching, launch, None)
    run = build(accelerator, recipe, batching)
    root = recipe.resolved_output_dir
    streamed, whole = os.path.join(root, "streamed"), os.path.join(root, "whole")
    # A first export imports what the export imports (its modules' memory is no export's): then measured.
    save_hf_model(accelerator, run.model, run.tokenizer, os.path.join(root, "warm-up"), run.save_dtype,
                  max_shard_size=SHARD_BYTES)
    streamed_peak = measured(lambda: save_hf_model(accelerator, run.model, run.tokenizer, streamed, run.save_dtype,
                                                   max_shard_size=SHARD_BYTES))
    whole_peak = measured(lambda: whole_model_export(accelerator, run.model, whole, run.save_dtype))
    if accelerator.is_main_process:
        written, expected = files(streamed), files(whole)
        index = "model.safetensors.index.json"
        streamed_index, whole_index = json.loads(written.pop(index)), json.loads(expected.pop(index))
        tensors = load_sharded(whole)
        print("probe:", json.dumps({
            "streamed_files": sorted(written), "whole_files": sorted(expected),
            "same_bytes": [name for name in expected if written.get(name) == expected[name]],
            "same_weight_map": streamed_index["weight_map"] == whole_index["weight_map"],
            "same_total_size": streamed_index["metadata"]["total_size"] == whole_index["metadata"]["total_size"],
            "total_parameters": streamed_index["metadata"]["total_parameters"],
            "whole_total_parameters": whole_index["metadata"]["total_parameters"],
            "parameters": sum(tensor.numel() for tensor in tensors.values()),
            "largest_elements": max(tensor.numel() for tensor in tensors.values()),
            "streamed_peak_bytes": streamed_peak, "whole_peak_bytes": whole_peak, "shard_bytes": SHARD_BYTES,
            "model_bytes": sum(len(data) for data in expected.values()),
        }), flush=True)
    shut_down(accelerator)


if __name__ == "__main__":
    main()

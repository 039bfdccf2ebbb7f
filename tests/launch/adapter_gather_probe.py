"""Launched by tests/launch/test_peft.py under `accelerate launch` with the tiny recipe's flags and --use_peft: the
model built and prepared as the trainer builds it, then the bytes each rank receives from all-gathers while
shardtune.export.model writes the adapter, and while accelerate's get_state_dict gathers the same model. The main
process prints one JSON line: both byte counts, the written adapter's and the whole model's size, and whether the
written adapter equals peft's adapter state of that whole state dict."""

from __future__ import annotations

import json

from shardtune.cli import checked_launch, startup_heap_frozen

with startup_heap_frozen():  # the imports as a recipe's launch makes them (shardtune.cli.main)
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardtune.config import Recipe
    from shardtune.export.model import save_hf_model
    from shardtune.parallel.distributed import make_accelerator, shut_down
    from shardtune.trainer import build


def tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [tensor for item in value for tensor in tensors(item)]
    return []


class GatheredBytes(TorchDispatchMode):
    """Bytes received by all-gathers, as the dispatcher sees them: DTensor's functional collectives (FSDP2) and
    torch.distributed's all_gather calls (DeepSpeed)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if "all_gather" in name:  # _c10d_functional::all_gather_into_tensor: the result is the gathered tensor
            self.bytes += sum(tensor.nbytes for tensor in tensors(out))
        elif "allgather" in name:  # c10d::_allgather_base_, allgather_, ...: the outputs are the first argument
            self.bytes += sum(tensor.nbytes for tensor in tensors(args[0]))
        return out


def main() -> None:
    recipe, launch, batching = checked_launch(Recipe(name="tiny", max_seq_length=64), None)
    accelerator = make_accelerator(recipe, batching, launch, None)
    run = build(accelerator, recipe, batching)
    unwrapped = accelerator.unwrap_model(run.model)
    with GatheredBytes() as export_gather:
        save_hf_model(accelerator, run.model, run.tokenizer, recipe.resolved_output_dir)
    with GatheredBytes() as state_dict_gather:
        whole = accelerator.get_state_dict(run.model)
    if accelerator.is_main_process:
        from peft import get_peft_model_state_dict
        from safetensors.torch import load_file

        written = load_file(f"{recipe.resolved_output_dir}/adapter_model.safetensors")
        expected = get_peft_model_state_dict(unwrapped, state_dict=whole)
        print("probe:", json.dumps({
            "export_gathered_bytes": export_gather.bytes, "state_dict_gathered_bytes": state_dict_gather.bytes,
            "adapter_bytes": sum(tensor.nbytes for tensor in written.values()),
            "model_bytes": sum(tensor.nbytes for tensor in whole.values()),
            "same_adapter": written.keys() == expected.keys()
            and all(torch.equal(written[key], expected[key]) for key in expected),
        }), flush=True)
    shut_down(accelerator)


if __name__ == "__main__":
    main()

"""A training checkpoint as a Hugging Face model directory (scripts/export_hf.py): DDP / single process
(model.safetensors), FSDP sharded state (torch.distributed.checkpoint), DeepSpeed ZeRO partitions (DeepSpeed's
zero_to_fp32, fp32 master weights, the NVMe swap files too). A full fine-tune's checkpoint is converted shard by
shard: at most one output shard is held in memory. A LoRA run's checkpoint holds the peft model (the frozen base
and the adapters, under peft's names): it is merged (peft's merge_and_unload, in fp32, from the checkpoint's own
weights) into the base model's class, or written as the adapter alone (peft's format), the whole model in host
memory either way."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardtune.export.model import MAX_SHARD_SIZE, SHARD_PATTERN, cast_floating

DCP_PREFIX = "model."  # accelerate's save_fsdp_model nests the model state under "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
ADAPTER_CONFIG = "adapter_config.json"  # peft's CONFIG_NAME: each LoRA checkpoint holds its run's LoRA settings
PEFT_PREFIX = "base_model.model."  # a PeftModel's state dict: the wrapped model's names under this prefix
LORA_TENSOR = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


class ExportError(Exception):
    """A checkpoint this export cannot write as what it claims; the message says why and what to do."""


def stated_dtype(checkpoint: Path) -> torch.dtype | None:
    """The dtype the checkpoint's config.json states; None where it states none (the weights stay as stored)."""
    config = checkpoint / "config.json"
    name = json.loads(config.read_text()).get("dtype") if config.is_file() else None
    return getattr(torch, name) if isinstance(name, str) and name else None


def export(checkpoint: Path, output: Path, dtype: torch.dtype | None = None, adapter: bool = False) -> str:
    """Write `checkpoint`'s model in `output` in `dtype` (None: as stored); a LoRA run's merged, or its adapter
    alone with `adapter`. Returns what was written: "model", "merged model" (a LoRA run's) or "adapter"."""
    lora = lora_settings(checkpoint)
    if adapter and lora is None:
        raise ExportError(f"{checkpoint} is not a LoRA run's checkpoint: it has no adapter to export; leave out "
                          "--adapter.")
    if lora is not None:
        export_lora(checkpoint, output, lora, dtype, adapter)
        return "adapter" if adapter else "merged model"
    fsdp_state = checkpoint / "pytorch_model_fsdp_0"
    if (checkpoint / "model.safetensors").is_file():
        export_single(checkpoint / "model.safetensors", output / "model.safetensors", dtype)
    elif fsdp_state.is_dir():
        export_fsdp(fsdp_state, output, dtype)
    elif (checkpoint / "pytorch_model" / "offloaded_tensors").is_dir():
        write_shards(zero_nvme_state(checkpoint / "pytorch_model"), output, dtype or torch.float32)
    else:
        # DeepSpeed takes seconds to import and only ZeRO checkpoints need it.
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

        # The fp32 master weights, assembled from the ZeRO partitions and cast shard by shard.
        convert_zero_checkpoint_to_state_dict(
            str(checkpoint), str(output), dtype=dtype or torch.float32, tag="pytorch_model",
            safe_serialization=True, max_shard_size=MAX_SHARD_SIZE,
        )
    copy_model_files(checkpoint, output, MODEL_FILES)
    write_config_dtype(output, written_dtype(output))
    return "model"


def copy_model_files(checkpoint: Path, output: Path, names: tuple[str, ...]) -> None:
    for name in names:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, output / name)  # the content, with the mode a new file gets


# ------------------------------------------------------------------------------------------------ LoRA runs


def lora_settings(checkpoint: Path):
    """The LoRA settings of a LoRA run's checkpoint (a peft LoraConfig), or None for a full fine-tune's: the
    checkpoint's adapter_config.json, or, for a checkpoint saved before checkpoints held one, the recipe in the
    run_config.json of the run's output_dir beside it. A checkpoint of peft tensors without either is refused."""
    from peft import LoraConfig

    if (checkpoint / ADAPTER_CONFIG).is_file():
        return LoraConfig.from_pretrained(str(checkpoint))
    run_config = checkpoint.parent / "run_config.json"
    if run_config.is_file():
        recorded = json.loads(run_config.read_text()).get("recipe", {})
        if recorded.get("use_peft"):
            from shardtune.config import Recipe
            from shardtune.model import lora_config

            fields = {field.name for field in dataclasses.fields(Recipe)}
            recipe = Recipe(**{name: value for name, value in recorded.items() if name in fields})
            config = lora_config(recipe)
            config.base_model_name_or_path = recipe.model_name_or_path  # recorded absolute where local
            return config
        return None
    if any(name.startswith(PEFT_PREFIX) for name in state_names(checkpoint)):
        raise ExportError(f"{checkpoint} is a LoRA run's checkpoint without its LoRA settings (no {ADAPTER_CONFIG} "
                          "in it, no run_config.json beside it): copy the run's adapter_config.json (in its "
                          "output_dir) into the checkpoint and export again.")
    return None


def state_names(checkpoint: Path) -> list[str]:
    """The names of the model tensors a checkpoint holds (headers and metadata only)."""
    if (checkpoint / "model.safetensors").is_file():
        with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as file:
            return list(file.keys())
    if (checkpoint / "pytorch_model_fsdp_0").is_dir():
        metadata = dcp.FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata()
        return list(hf_names(metadata.state_dict_metadata))
    from deepspeed.utils import zero_to_fp32

    names = []
    for path in zero_to_fp32.get_model_state_files(str(checkpoint / "pytorch_model"))[:1]:
        states = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        for key in ("param_shapes", "frozen_param_shapes"):
            shapes = states.get(key) or {}
            for group in shapes if isinstance(shapes, list) else [shapes]:
                names.extend(group)
    return names


def checkpoint_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint, whole, in host memory, under the model's own names."""
    if (checkpoint / "model.safetensors").is_file():
        return load_file(str(checkpoint / "model.safetensors"))
    state_dir = checkpoint / "pytorch_model_fsdp_0"
    if state_dir.is_dir():
        metadata = dcp.FileSystemReader(str(state_dir)).read_metadata()
        state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
                 for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(state_dir)), no_dist=True)
        return hf_names(state)
    from deepspeed.utils import zero_to_fp32

    if (checkpoint / "pytorch_model" / "offloaded_tensors").is_dir():
        return zero_to_fp32.to_torch_tensor(zero_nvme_state(checkpoint / "pytorch_model"))
    return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")


def export_lora(checkpoint: Path, output: Path, lora, dtype: torch.dtype | None, adapter: bool) -> None:
    """The peft model rebuilt from the checkpoint's weights under the run's LoRA settings (each adapter tensor
    loaded under its own name, none left out), then peft writes the adapter, or merges it (in fp32) into the
    base, which transformers writes in `dtype`. The base's tensors go through transformers' own loading of the
    base class (tied weights, names), which refuses a base it would not load whole."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.export.checks import listed, model_class, quiet_loading

    config = AutoConfig.from_pretrained(checkpoint)
    state = checkpoint_state(checkpoint)
    adapters = {name: state.pop(name) for name in list(state) if LORA_TENSOR.search(name)}
    if not adapters:
        raise ExportError(f"{checkpoint} has LoRA settings but holds no adapter tensor (lora_A, lora_B): it is not "
                          "a LoRA run's checkpoint; remove its adapter_config.json and export again.")
    if any(name.endswith((".absmax", ".quant_map")) or "quant_state" in name for name in state):
        raise ExportError(f"{checkpoint} holds its base in 4-bit (QLoRA): export the adapter with --adapter, then "
                          "merge it into the 16-bit base with scripts/merge_lora.py.")
    with quiet_loading():
        if adapter:  # the base is only the adapter's frame: its structure, no weights
            with torch.device("meta"):
                base = AutoModelForCausalLM.from_config(config)
        else:
            base_state = {name.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): tensor.float()
                          for name, tensor in state.items()}
            base, info = model_class(config).from_pretrained(None, config=config, state_dict=base_state,
                                                             dtype=torch.float32, output_loading_info=True)
            wrong = [*info["missing_keys"], *info["unexpected_keys"], *info["mismatched_keys"]]
            if wrong:
                raise ExportError(f"{checkpoint}'s base weights do not load as {type(base).__name__} "
                                  f"({listed(map(str, wrong))}): export an earlier checkpoint, or merge the run's "
                                  "adapter with scripts/merge_lora.py.")
    del state
    base.name_or_path = lora.base_model_name_or_path  # the adapter's base, which peft records: not the checkpoint
    model = get_peft_model(base, lora)
    if adapter and dtype is not None:
        cast_floating(adapters, dtype)
    loaded = model.load_state_dict(adapters, strict=False, assign=adapter)
    left_out = [name for name in loaded.missing_keys if LORA_TENSOR.search(name)]
    if loaded.unexpected_keys or left_out:
        raise ExportError(f"{checkpoint}'s adapter does not match its LoRA settings ({ADAPTER_CONFIG}): "
                          f"{listed([*loaded.unexpected_keys, *left_out])}; give the checkpoint its run's settings.")
    if adapter:
        model.save_pretrained(str(output), safe_serialization=True)
        copy_model_files(checkpoint, output, TOKENIZER_FILES)  # as the run's own adapter export holds them
        return
    merged = model.merge_and_unload()
    if dtype is not None:
        merged.to(dtype)
    merged.save_pretrained(str(output), safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    copy_model_files(checkpoint, output, MODEL_FILES)
    write_config_dtype(output, written_dtype(output))


# ------------------------------------------------------------------------------------ full fine-tuning runs


def zero_nvme_state(ds_dir: Path) -> dict:
    """A ZeRO-3 checkpoint of a run whose optimizer was on NVMe: DeepSpeed saves the swapped sub-groups' fp32
    master weights as empty tensors in optim_states.pt and their data in offloaded_tensors/ (the swap files), so
    zero_to_fp32 alone fails on the element count. The swap files fill the empty sub-groups, then zero_to_fp32
    assembles the parameters (lazily: each is built when converted)."""
    from deepspeed.utils import zero_to_fp32

    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(ds_dir)))
    optim_files = zero_to_fp32.get_optim_files(str(ds_dir))
    world = len(optim_files)
    flat_groups = [nvme_filled_flat_groups(Path(path), ds_dir / "offloaded_tensors" / f"rank{rank:02d}",
                                           model_states[rank].param_shapes, world)
                   for rank, path in enumerate(optim_files)]
    return zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, False)


def write_shards(state: dict, output: Path, dtype: torch.dtype) -> None:
    """zero_to_fp32's lazy state written one output shard at a time, in `dtype`."""
    from deepspeed.utils import zero_to_fp32

    empty = zero_to_fp32.to_torch_tensor(state, return_empty_tensor=True, dtype=dtype)
    split = split_torch_state_dict_into_shards(empty, filename_pattern=SHARD_PATTERN, max_shard_size=MAX_SHARD_SIZE)
    for filename, keys in split.filename_to_tensors.items():
        shard = zero_to_fp32.to_torch_tensor({key: state.pop(key) for key in keys}, dtype=dtype)
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
            raise ExportError(f"{path} matches {len(fits)} of the checkpoint's swapped optimizer sub-groups; "
                              "export the run's own model.safetensors instead.")
        index = fits[0].pop(0)
        flat[index] = torch.from_file(str(path), size=elements, dtype=torch.float32)[:lengths[index]]
    missing = [index for queue in waiting for index in queue]
    if missing:
        raise ExportError(f"{swap_dir} lacks the swap files of optimizer sub-groups {missing}: export an earlier "
                          "checkpoint.")
    return flat


def export_single(source: Path, target: Path, dtype: torch.dtype | None) -> None:
    """A DDP / single-process checkpoint's one safetensors file, cast (or copied as it is)."""
    if dtype is None:
        shutil.copyfile(source, target)
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
    split = split_torch_state_dict_into_shards(empty, filename_pattern=SHARD_PATTERN, max_shard_size=MAX_SHARD_SIZE)
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

"""A checkpoint's tensor files: torch.save files and safetensors files, the latter streamed from the tensors'
memory."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from accelerate.utils.other import clean_state_dict_for_safetensors

from shardtune.checkpoint.durable import write_all

# torch dtype -> safetensors dtype, in the order safetensors lays tensors out (widest first, so each is aligned).
SAFETENSORS_DTYPES = {"int64": "I64", "float64": "F64", "float32": "F32", "int32": "I32", "bfloat16": "BF16",
                      "float16": "F16", "int16": "I16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
                      "int8": "I8", "uint8": "U8", "bool": "BOOL"}
DTYPE_ORDER = {name: index for index, name in enumerate(SAFETENSORS_DTYPES)}


def write_torch(obj: Any, path: str, zipfile: bool = True) -> None:
    """torch.save, in the zipfile format or (`zipfile=False`, as a DeepSpeed config may ask) the legacy one."""
    torch.save(obj, path, _use_new_zipfile_serialization=zipfile)


def write_safetensors(state_dict: dict[str, torch.Tensor], path: str) -> None:
    """The safetensors file accelerate's save writes (tied tensors such as shared embeddings stored once, the
    same metadata), streamed from the tensors' memory: safetensors' own writer builds the whole file in memory
    first, which halves its rate and doubles the host memory of a background save."""
    cleaned = clean_state_dict_for_safetensors(dict(state_dict))
    dtype = {name: str(tensor.dtype).removeprefix("torch.") for name, tensor in cleaned.items()}
    tensors = {name: cleaned[name] for name in sorted(cleaned, key=lambda name: (DTYPE_ORDER[dtype[name]], name))}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype[name]],
                        "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, len(encoded).to_bytes(8, "little") + encoded)
        for tensor in tensors.values():
            if tensor.numel():
                write_all(fd, tensor.reshape(-1).view(torch.uint8).cpu().numpy().data)
    finally:
        os.close(fd)

"""What an export wrote loads as what it claims: a model directory's weights are the keys and shapes of the class its
config.json names (transformers' own loading decides, from the safetensors headers alone, on the meta device: no
weight is read), an adapter directory's are those of peft's adapter for the base config. scripts/export_hf.py and
scripts/merge_lora.py check what they wrote before it takes its name, so a mismatch is refused, not published."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import SAFE_WEIGHTS_NAME

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def header_tensors(directory: Path, single: str = SAFE_WEIGHTS_NAME) -> dict[str, torch.Tensor]:
    """The tensors a model directory's safetensors files hold, as meta tensors of their shape and dtype (read from
    the headers). Sharded: every file the index names, and each tensor in the file the index says."""
    index = directory / f"{single}.index.json"  # save_pretrained's name: model.safetensors.index.json
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [single]
    tensors = {}
    for name in files:
        with safe_open(str(directory / name), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                sliced = file.get_slice(key)
                tensors[key] = torch.empty(sliced.get_shape(), dtype=SAFETENSORS_DTYPES[sliced.get_dtype()],
                                           device="meta")
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        if weight_map.keys() != tensors.keys():
            raise ValueError(f"its {index.name} names {len(weight_map)} tensors and its files hold {len(tensors)}")
    return tensors


def listed(names: Iterable[str], limit: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' load report and progress bar off: the check states its own finding in one line."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()


def model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The class config.json claims (its `architectures`), else the causal LM auto class's for the config."""
    import transformers

    names = getattr(config, "architectures", None) or []
    found = getattr(transformers, names[0], None) if names else None
    return found or AutoModelForCausalLM._model_mapping[type(config)]


def model_problem(directory: str | Path) -> str | None:
    """Why the model directory would not load whole as the class its config.json names, or None: a weight that
    class has and the files lack (it would be left random), a tensor it has no place for, a shape that differs."""
    directory = Path(directory)
    try:
        config = AutoConfig.from_pretrained(directory)
        cls = model_class(config)
        written = header_tensors(directory)
    except (OSError, ValueError, KeyError) as error:
        return f"it does not read back as a model directory ({error})"
    with quiet_loading():
        _, info = cls.from_pretrained(None, config=config, state_dict=written, device_map="meta",
                                      ignore_mismatched_sizes=True, output_loading_info=True)
    problems = []
    if info["missing_keys"]:
        problems.append(f"{len(info['missing_keys'])} of {cls.__name__}'s weights are missing "
                        f"({listed(info['missing_keys'])}): they would load random")
    if info["unexpected_keys"]:
        problems.append(f"{len(info['unexpected_keys'])} tensors have names {cls.__name__} does not have "
                        f"({listed(info['unexpected_keys'])})")
    mismatched = [str(key[0] if isinstance(key, tuple) else key) for key in info["mismatched_keys"]]
    if mismatched:
        problems.append(f"{len(mismatched)} tensors have another shape than {cls.__name__}'s ({listed(mismatched)})")
    return "; ".join(problems) or None


def adapter_problem(directory: str | Path, base_config: PretrainedConfig) -> str | None:
    """Why the adapter directory would not load whole into peft's adapter for a model of `base_config`, or None:
    the tensors written must be the adapter's tensors (peft's own selection and names), of the adapter's shapes."""
    from peft import PeftConfig, get_peft_model, get_peft_model_state_dict
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME as ADAPTER_WEIGHTS_NAME

    directory = Path(directory)
    try:
        adapter_config = PeftConfig.from_pretrained(str(directory))
        written = header_tensors(directory, ADAPTER_WEIGHTS_NAME)
    except (OSError, ValueError, KeyError) as error:
        return f"it does not read back as a peft adapter ({error})"
    with quiet_loading(), torch.device("meta"):
        base = model_class(base_config)._from_config(base_config)
    base.name_or_path = adapter_config.base_model_name_or_path  # peft would otherwise warn that it differs
    expected = get_peft_model_state_dict(get_peft_model(base, adapter_config))
    problems = []
    if expected.keys() - written.keys():
        problems.append(f"{len(expected.keys() - written.keys())} of the adapter's tensors are missing "
                        f"({listed(expected.keys() - written.keys())})")
    if written.keys() - expected.keys():
        problems.append(f"{len(written.keys() - expected.keys())} tensors are not the adapter's "
                        f"({listed(written.keys() - expected.keys())})")
    shapes = [key for key in expected.keys() & written.keys() if expected[key].shape != written[key].shape]
    if shapes:
        problems.append(f"{len(shapes)} tensors have another shape than the adapter's ({listed(shapes)})")
    return "; ".join(problems) or None

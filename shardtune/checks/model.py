"""The recipe against the model's config.json, read without a weight: the model can be had and is of a family
shardtune plans, a local model directory holds its weights and tokenizer, the model has room for
--max_seq_length, --lora_target_modules name some of its layers, and --use_liger_kernel knows its family."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import TYPE_CHECKING

from shardtune.config import ConfigError, Problems, Recipe, padded_length, token_multiple
from shardtune.levers.liger import check_liger_model
from shardtune.parallel.context import check_context_model
from shardtune.parallel.sequence import check_split_heads
from shardtune.parallel.tensor import check_tensor_parallel_heads

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# A Git LFS pointer file (a clone made without git-lfs) starts with this line instead of the weights.
LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def check_model(recipe: Recipe, sp_size: int = 1, tp_size: int = 1, cp_size: int = 1) -> None:
    """What the model's config.json and its directory's listing (no weights read) can tell: it exists, can be
    read and is of a supported family, a local directory holds whole weights and a tokenizer, it has room for
    --max_seq_length, --lora_target_modules name some of its layers, and a sequence split over `sp_size` ranks
    divides its attention heads, as tensor parallelism over `tp_size` ranks must; the ring attention over `cp_size`
    ranks takes no sliding window; and the model's family allows the levers asked for (check_family_levers)."""
    config = read_model_config(recipe.model_name_or_path)
    problems = Problems()
    if os.path.isdir(recipe.model_name_or_path):  # a Hub id's files are fetched, and judged, when it loads
        problems.check(check_weights, recipe.model_name_or_path, config)
        problems.check(check_tokenizer_files, recipe.model_name_or_path)
    problems.check(check_context_length, recipe, config)
    problems.check(check_lora_targets, recipe, config)
    problems.check(check_liger_model, recipe, config)
    problems.check(check_split_heads, config, sp_size)
    problems.check(check_tensor_parallel_heads, config, tp_size)
    problems.check(check_context_model, config, cp_size)
    problems.check(check_family_levers, recipe, config, sp_size, tp_size, cp_size)
    problems.raise_any()


def check_family_levers(recipe: Recipe, config: PretrainedConfig, sp_size: int, tp_size: int, cp_size: int = 1
                        ) -> None:
    """The levers a family refuses (shardtune.models.families): tensor parallelism where its plan is not the one
    planned or proven; Ulysses over sliding-window layers under a kernel that takes the window from the mask
    Ulysses drops (flash attention reads it from the module instead); DPO's log-probs, which read the LM head's
    output as it comes, on a model that scales or soft-caps its logits; on a mixture of experts, what cannot carry
    its router's loss (a split of the rows, DPO's loss) or leaves its experts unplanned (float8, LoRA, selective
    recomputation)."""
    from shardtune.levers.tiled_loss import logits_after_head
    from shardtune.models.families import FAMILIES, layer_types

    text = config.get_text_config()
    family = FAMILIES[text.model_type]
    problems = []
    if tp_size > 1 and family.tensor_parallel_refusal:
        problems.append(f"tensor parallelism (tp_size {tp_size}) on a {text.model_type} model: "
                     f"{family.tensor_parallel_refusal}")
    window = getattr(text, "sliding_window", None) or 0
    sliding = "sliding_attention" in layer_types(text) and 0 < window < recipe.max_seq_length
    if sp_size > 1 and sliding and not recipe.attn_implementation.startswith("flash_attention"):
        problems.append(f"The model's sliding-window layers attend {window} positions back, and Ulysses (sp_size "
                     f"{sp_size}) drops the attention mask that carries the window under {recipe.attn_implementation}"
                     f": use --attn_implementation flash_attention_2 (which takes the window from the layer), or "
                     f"--max_seq_length {window}.")
    if recipe.method == "dpo" and logits_after_head(text) != (1.0, None):
        problems.append(f"--method dpo computes log-probs from the LM head's output as it comes, and this "
                     f"{text.model_type} model scales or soft-caps its logits after the head (logits_scaling, "
                     "final_logit_softcapping), which those log-probs would leave out: train it with --method sft.")
    problems += expert_refusals(recipe, text, sp_size, cp_size)
    if problems:
        raise ConfigError(problems)


def expert_refusals(recipe: Recipe, config: object, sp_size: int = 1, cp_size: int = 1) -> list[str]:
    """What a mixture of experts refuses of the recipe (shardtune.models.experts), a line each; [] for a dense
    model. The planner asks it too (shardtune.plan.planned_run.check_planned)."""
    from shardtune.models.experts import MOE_REFUSALS, is_mixture_of_experts

    if not is_mixture_of_experts(config):
        return []
    asked = {"sequence_split": sp_size > 1, "context_parallel": cp_size > 1,
             "fp8": recipe.mixed_precision == "fp8", "dpo": recipe.method == "dpo", "peft": recipe.use_peft,
             "selective": recipe.gradient_checkpointing and recipe.gradient_checkpointing_mode == "selective",
             "compile": recipe.torch_compile}
    return [f"A {config.model_type} model (a mixture of experts): {MOE_REFUSALS[lever]}"
            for lever, wanted in asked.items() if wanted]


def read_model_config(name: str) -> PretrainedConfig:
    """The model's config.json alone (shardtune.models.flops.read_config), a refusal when it cannot be had."""
    from shardtune.models.flops import ModelError, read_config

    try:
        return read_config(name)
    except ModelError as error:
        raise ConfigError(str(error)) from None


def check_weights(directory: str, config: PretrainedConfig) -> None:
    """The weights file that `from_pretrained` would pick (transformers' order: the config's own
    `transformers_weights`, else safetensors, a safetensors index, pytorch_model.bin, its index), every shard an
    index names, and each safetensors file whole: its header read, not its tensors."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    explicit = getattr(config, "transformers_weights", None)
    names = [explicit] if explicit else [SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME]
    found = next((name for name in names if os.path.isfile(os.path.join(directory, name))), None)
    if found is None:
        raise ConfigError(f"--model_name_or_path {directory!r} has a config.json but no weights ({' or '.join(names)}):"
                          " save the model there (model.save_pretrained), or download it whole "
                          "(hf download MODEL_ID --local-dir DIR).")
    files = [found]
    if found.endswith(".index.json"):
        files = index_shards(directory, found)
        missing = [name for name in files if not os.path.isfile(os.path.join(directory, name))]
        if missing:
            raise ConfigError(f"{os.path.join(directory, found)} names {len(missing)} of its {len(files)} shard(s) "
                              f"that are not in the directory, first {missing[0]!r}: the download stopped part way. "
                              "Download the model again (hf download MODEL_ID --local-dir DIR).")
    shapes = {name: check_weights_file(os.path.join(directory, name)) for name in files}
    if all(name.endswith(".safetensors") for name in files) and not getattr(config, "quantization_config", None):
        check_weight_shapes(directory, shapes, config)


def index_shards(directory: str, index: str) -> list[str]:
    """The shard files a `*.index.json` maps the weights to, in order."""
    path = os.path.join(directory, index)
    try:
        with open(path, encoding="utf-8") as file:
            weight_map = json.load(file)["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"{path} is not a weights index ({type(error).__name__}: {error}): download the model "
                          "again (hf download MODEL_ID --local-dir DIR).") from None


def check_weights_file(path: str) -> dict[str, list[int]]:
    """A weights file that holds weights: not a Git LFS pointer, and for safetensors a header that safetensors
    reads and a file as long as the header says (a cut-off download fails here, not minutes into loading).
    Returns each tensor's shape as the safetensors header gives it (no tensor read; {} for other files)."""
    with open(path, "rb") as file:
        start = file.read(len(LFS_POINTER))
    if start == LFS_POINTER:
        raise ConfigError(f"{path} is a Git LFS pointer, not the weights: the model was cloned without git-lfs. Run "
                          f"`git lfs pull` in {os.path.dirname(path)!r}, or download it with hf download.")
    if not path.endswith(".safetensors"):
        return {}
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as weights:
            return {name: list(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        raise ConfigError(f"{path} is not whole safetensors weights ({error}): the file is damaged or cut short. "
                          "Download it again.") from None


def check_weight_shapes(directory: str, shapes: dict[str, dict[str, list[int]]], config: PretrainedConfig) -> None:
    """The weights' shapes against the model config.json describes (built on the meta device): a config.json of
    another size (a copied or edited one) would load only to fail in transformers' loading report, after the data
    was tokenized. Names the weights file and the model do not share are left to the loading."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    differing = [(name, file, shape, expected[name]) for file, in_file in shapes.items()
                 for name, shape in in_file.items() if name in expected and shape != expected[name]]
    if differing:
        name, file, shape, wanted = differing[0]
        sizes = ", ".join(f"{key} {getattr(config, key)}" for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                                     "num_attention_heads", "num_key_value_heads"))
        raise ConfigError(f"{os.path.join(directory, 'config.json')} does not describe the weights beside it: "
                          f"{len(differing)} tensor(s) differ in shape, first {name} ({shape} in {file}, {wanted} "
                          f"for {sizes}). Use the config.json that came with these weights.")


def check_tokenizer_files(directory: str) -> None:
    """The files AutoTokenizer builds a tokenizer from: tokenizer.json (every supported family ships it), a BPE
    vocab.json with merges.txt, or a SentencePiece tokenizer.model, which needs sentencepiece and protobuf."""
    names = set(os.listdir(directory))
    if "tokenizer.json" in names or {"vocab.json", "merges.txt"} <= names:
        return
    if "tokenizer.model" in names:
        missing = [package for package, module in (("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf"))
                   if not installed(module)]
        if missing:
            raise ConfigError(f"--model_name_or_path {directory!r} has its tokenizer as tokenizer.model (SentencePiece)"
                              f" without tokenizer.json, and reading it needs {' and '.join(missing)}: pip install "
                              f"{' '.join(missing)}, or add the model's tokenizer.json.")
        return
    raise ConfigError(f"--model_name_or_path {directory!r} has no tokenizer (tokenizer.json, or vocab.json and "
                      "merges.txt, or tokenizer.model): save it there (tokenizer.save_pretrained), or copy those files "
                      "from the model it was fine-tuned from.")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package of a dotted name is missing
        return False


def check_context_length(recipe: Recipe, config: PretrainedConfig) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    padded, multiple = padded_length(recipe), token_multiple(recipe)  # a padded row's positions run to its end
    if limit and padded > limit:
        length = f"--max_seq_length {recipe.max_seq_length}" + (
            f" padded to a multiple of {multiple} ({padded})" if padded != recipe.max_seq_length else "")
        raise ConfigError(f"{length} is above the model's max_position_embeddings {limit}: give --max_seq_length "
                          f"{limit // multiple * multiple} or less.")


def check_lora_targets(recipe: Recipe, config: PretrainedConfig) -> None:
    """Each --lora_target_modules name must match a linear or embedding layer as peft matches it (the full name or
    its dotted suffix): peft refuses only when no name matches, and quietly drops a misspelt one otherwise."""
    if not recipe.use_peft or recipe.lora_target_modules.strip() == "all-linear":
        return
    import torch

    from shardtune.model import bitsandbytes_kept_out

    with bitsandbytes_kept_out(not recipe.load_in_4bit):  # the first import of peft would import it (see there)
        from peft import LoraConfig
        from peft.tuners.tuners_utils import check_target_module_exists

    layers = model_layers(config)
    unknown = []
    for target in recipe.lora_target_modules.split(","):
        wanted = LoraConfig(target_modules=[target.strip()])
        if not any(isinstance(module, torch.nn.Linear | torch.nn.Embedding)
                   and check_target_module_exists(wanted, name) for name, module in layers.items()):
            unknown.append(target.strip())
    if unknown:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in layers.items()
                         if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")})
        raise ConfigError(f"--lora_target_modules {', '.join(map(repr, unknown))} names no layer of the model: its "
                          f"linear modules are {', '.join(linear)} (or give all-linear).")


def model_layers(config: PretrainedConfig) -> dict:
    """The model's modules by name, built on the meta device from its config: structure only, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    return dict(model.named_modules())

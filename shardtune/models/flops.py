"""Model shapes, exact parameter counts, FLOPs per token and MFU, all without loading a weight.

    python -m shardtune.models.flops --model llama-3.1-70b --tokens_per_second 400 --gpus 8 --gpu h100 [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from shardtune.models.builtin import ALIASES, BUILTIN_CONFIG_VALUES
from shardtune.models.experts import ROUTER_FIRST, expert_sizes
from shardtune.models.families import MIXTURE_OF_EXPERTS_TYPES, SUPPORTED_MODEL_TYPES, family_of, layer_types
from shardtune.plan.hardware import PEAK_BF16_FLOPS, peak_flops

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_SEQ_LEN = 4096  # the recipes' max_seq_length


# The built-in shapes and the families live in shardtune.models; imported here, where the planner reads them.
BUILTIN_MODELS = tuple(BUILTIN_CONFIG_VALUES)
# The config.json fields a shape is read from. transformers fills a missing one with its config class's default
# (LlamaConfig's are Llama 2 7B's), which plans and builds some other model than the one whose weights load.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def builtin_configs() -> dict[str, PretrainedConfig]:
    """The built-in models as transformers configs (built fresh: configs are mutable)."""
    from transformers import CONFIG_MAPPING

    return {name: CONFIG_MAPPING[values["model_type"]](**{k: v for k, v in values.items() if k != "model_type"})
            for name, values in BUILTIN_CONFIG_VALUES.items()}


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs and memory formulas need from a dense decoder's config (shardtune.models.families)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    family: str = "llama"
    qk_norms: tuple[int, ...] = ()  # a layer's q and k norm weights (Qwen3, Gemma 3: head_dim; OLMo 2: q, k widths)
    layer_norms: int = 2  # hidden-size RMSNorms per layer (Gemma 3: 4)
    norm_scale_fp32: bool = False  # Gemma's norms scale by (1 + weight) in fp32, keeping an fp32 copy for backward
    sliding_layers: int = 0  # layers whose attention reaches back sliding_window positions only
    sliding_window: int = 0
    logits_scaling: float = 1.0  # Granite divides the logits by it
    final_logit_softcapping: float | None = None  # Gemma: tanh(logits / c) x c where the config sets it
    # A mixture of experts (shardtune.models.experts): each layer's MLP is `experts` gated MLPs of `intermediate`
    # width (the expert's) behind a router of experts x hidden, and each token runs `experts_per_token` of them.
    experts: int = 0
    experts_per_token: int = 0

    @property
    def attention_matmul_params(self) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden

    @property
    def routed(self) -> int:
        """Gated MLPs a token runs per layer: its top-k experts, or the one dense MLP."""
        return self.experts_per_token if self.experts else 1

    def mlp_matrices(self) -> list[tuple[int, int]]:
        """One layer's MLP weights as torch holds them (rows x columns, a packed 3-D expert tensor as experts·rows x
        columns), in parameter order: gate, up and down; or the router and the packed experts' gate_up and down."""
        h, inter = self.hidden, self.intermediate
        if not self.experts:
            return [(inter, h), (inter, h), (h, inter)]
        experts = [(self.experts * 2 * inter, h), (self.experts * h, inter)]
        return [(self.experts, h), *experts] if ROUTER_FIRST[self.family] else [*experts, (self.experts, h)]

    @property
    def router_params(self) -> int:
        return self.experts * self.hidden

    @property
    def layer_matmul_params(self) -> int:
        """Weights of q, k, v, o and the three gated-MLP projections of one decoder layer (every expert's, and the
        router, in a mixture of experts)."""
        return self.attention_matmul_params + 3 * self.hidden * self.intermediate * max(self.experts, 1) + \
            self.router_params

    @property
    def active_layer_matmul_params(self) -> int:
        """The weights one token's compute reads in a layer: attention, the router and its top-k experts."""
        return self.attention_matmul_params + 3 * self.hidden * self.intermediate * self.routed + self.router_params

    @property
    def layer_norm_params(self) -> int:
        """The RMSNorm weights of one layer: its hidden-size norms and the q/k norms."""
        return self.layer_norms * self.hidden + sum(self.qk_norms)

    @property
    def layer_params(self) -> int:
        """Matmul weights plus biases and the RMSNorm weights."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        biases = (q_out + 2 * kv_out) * self.qkv_bias + self.hidden * self.o_bias
        biases += (2 * self.intermediate + self.hidden) * self.mlp_bias
        return self.layer_matmul_params + biases + self.layer_norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Exact count as `sum(p.numel() for p in model.parameters())` (tied lm_head counted once)."""
        lm_head = 0 if self.tied else self.embedding_params
        return self.embedding_params + lm_head + self.layers * self.layer_params + self.hidden  # + final norm

    @property
    def non_embedding_matmul_params(self) -> int:
        """N of the PaLM FLOPs formula: every matmul weight a token's compute reads, lm_head included (it is a
        matmul even when tied to the input embedding, which is a lookup and does no FLOPs); in a mixture of
        experts the router and the token's top-k experts, not the others (MFU counts active parameters)."""
        return self.layers * self.active_layer_matmul_params + self.embedding_params

    @property
    def linear_params(self) -> int:
        """The weights that run through F.linear, which autocast casts to 16 bits (cached per step): every matmul
        weight but the experts', whose grouped matmuls transformers casts to the weights' own dtype."""
        mlp = self.router_params if self.experts else 3 * self.hidden * self.intermediate
        return self.layers * (self.attention_matmul_params + mlp) + self.embedding_params

    def attended_positions(self, seq_len: int) -> int:
        """Key positions summed over the layers at sequence length T: T for a global layer, min(window, T) for a
        sliding one (counted without causal savings, as PaLM counts)."""
        window = min(self.sliding_window, seq_len) if self.sliding_window else seq_len
        return (self.layers - self.sliding_layers) * seq_len + self.sliding_layers * window


def shape_from_config(config: PretrainedConfig, name: str = "") -> ModelShape:
    check_architecture(config, name or getattr(config, "name_or_path", ""))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    model_type = getattr(config, "model_type", "llama")
    family = family_of(model_type)
    attention_bias = bool(getattr(config, "attention_bias", False))
    qk_norms = {"": (), "head": (head_dim, head_dim), "width": (heads * head_dim, kv_heads * head_dim)}[family.qk_norm]
    sliding = sum(kind == "sliding_attention" for kind in layer_types(config))
    try:
        experts, experts_per_token, intermediate = expert_sizes(config)
    except ValueError as error:
        raise ModelError(str(error)) from None
    return ModelShape(
        name=name or getattr(config, "name_or_path", "") or model_type,
        hidden=config.hidden_size, intermediate=intermediate, layers=config.num_hidden_layers,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias or attention_bias, o_bias=attention_bias and not family.qkv_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)), family=model_type, qk_norms=qk_norms,
        layer_norms=family.layer_norms, norm_scale_fp32=family.norm_scale_fp32, sliding_layers=sliding,
        sliding_window=(getattr(config, "sliding_window", None) or 0) if sliding else 0,
        logits_scaling=float(getattr(config, "logits_scaling", None) or 1.0),
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        experts=experts, experts_per_token=experts_per_token,
    )


class ModelError(ValueError):
    """A `--model` value that is neither built in, nor a local config, nor a recipe, or a model of an architecture
    that shardtune cannot plan."""


def check_architecture(config: PretrainedConfig, name: str = "") -> None:
    """Raise ModelError for a model outside SUPPORTED_MODEL_TYPES: its shape is not the one planned (a GPT-2 config
    has no intermediate_size at all)."""
    model_type = getattr(config, "model_type", None) or "unknown"
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    classes = getattr(config, "architectures", None) or []
    described = f"{model_type} model" + (f" ({', '.join(classes)})" if classes else "")
    if model_type in MIXTURE_OF_EXPERTS_TYPES:
        raise ModelError(f"{name or 'The model'!r} is a {described}, a mixture of experts that shardtune does not "
                         f"plan: give a model of model_type {', '.join(SUPPORTED_MODEL_TYPES)}.")
    if model_type == "gemma3":
        raise ModelError(f"{name or 'The model'!r} is Gemma 3's image-and-text model ({described}): shardtune "
                         "trains its text model, model_type gemma3_text; save the language model alone "
                         "(docs/models.md) and give that directory.")
    raise ModelError(f"{name or 'The model'!r} is a {described}: shardtune plans and trains dense decoders of "
                     f"model_type {', '.join(SUPPORTED_MODEL_TYPES)} (grouped-query attention, a gated MLP, "
                     "RMSNorm). Give a model of one of those families.")


def check_shape_fields(name: str) -> None:
    """Raise ModelError when config.json leaves out a field the shape is read from (SHAPE_FIELDS)."""
    from transformers import PretrainedConfig

    values, _ = PretrainedConfig.get_config_dict(name)
    missing = [field for field in SHAPE_FIELDS if values.get(field) is None]
    if missing:
        where = os.path.join(name, "config.json") if os.path.isdir(name) else f"The config.json of {name!r}"
        raise ModelError(f"{where} has no {', '.join(missing)}: transformers would fill "
                         f"{'it' if len(missing) == 1 else 'them'} with its class defaults, not this model's sizes. "
                         "Use the config.json that came with the model's weights.")


def builtin_name(model_id: str) -> str | None:
    """'meta-llama/Llama-3.1-70B' or 'llama-3.1-70b-instruct' -> 'llama-3.1-70b'; None when not built in."""
    key = model_id.rstrip("/").split("/")[-1].lower().removesuffix("-instruct")
    key = ALIASES.get(key, key)
    return key if key in BUILTIN_MODELS else None


def recipe_fields(path: str) -> dict:
    """The literal keyword values of `RECIPE = Recipe(...)` in a recipe file, read without running it (running
    a recipe may write assets or import the trainer)."""
    tree = ast.parse(open(path).read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RECIPE" for t in node.targets):
            if isinstance(node.value, ast.Call):
                fields = {}
                for keyword in node.value.keywords:
                    try:
                        fields[keyword.arg] = ast.literal_eval(keyword.value)
                    except ValueError:
                        fields[keyword.arg] = None  # computed at run time, e.g. the tiny recipe's model dir
                return fields
    raise ModelError(f"{path} defines no `RECIPE = Recipe(...)`.")


def resolve_config(model: str) -> tuple[str, PretrainedConfig]:
    """`--model`: a built-in name, a Hub id matching one, a local model directory or config.json, or a recipe."""
    if model.endswith(".py") and os.path.isfile(model):
        target = recipe_fields(model).get("model_name_or_path")
        if not target:
            raise ModelError(f"{model}: model_name_or_path is not a literal; pass the model directory instead.")
        return resolve_config(target)
    key = builtin_name(model)
    if key:
        return key, SimpleNamespace(**BUILTIN_CONFIG_VALUES[key])
    path = (os.path.dirname(model) or ".") if model.endswith(".json") else model
    if os.path.isfile(os.path.join(path, "config.json")):
        return os.path.basename(os.path.abspath(path)), read_config(path)
    try:
        config = read_config(model)
    except ModelError as error:
        raise ModelError(f"{error} The built-in shapes need no network: {', '.join(BUILTIN_MODELS)}.") from None
    return model.rstrip("/").split("/")[-1].lower(), config


def read_config(name: str) -> PretrainedConfig:
    """AutoConfig of a local model directory, or of a Hub id (from the cache, or downloaded: config.json only).
    A name that can only be a path and exists nowhere is "not found", never tried on the Hub. A model outside
    SUPPORTED_MODEL_TYPES, or whose config.json leaves out a shape field, is refused."""
    from transformers import AutoConfig

    from shardtune.hub import first_line, hub_problem, looks_like_path

    if os.path.isdir(name):
        adapter = os.path.isfile(os.path.join(name, "adapter_config.json"))
        if adapter and not os.path.isfile(os.path.join(name, "config.json")):
            raise ModelError(f"--model_name_or_path {name!r} is a LoRA adapter (adapter_config.json), not a model: "
                             f"merge it into its base (python scripts/merge_lora.py {name} MERGED_DIR) and give "
                             "MERGED_DIR.")
        if adapter:  # transformers would load the adapter's files beside the model's, which a checkpoint lacks
            raise ModelError(f"--model_name_or_path {name!r} is a LoRA run's checkpoint (adapter_config.json, the "
                             f"base and adapters under peft's names): export it merged (python scripts/export_hf.py "
                             f"{name} MERGED_DIR) and give MERGED_DIR, or resume its run with "
                             f"--resume_from_checkpoint {name}.")
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ModelError(f"--model_name_or_path {name!r} is a directory without config.json: give a model "
                              "directory written by save_pretrained, or a Hub model id.")
    elif os.path.exists(name):
        raise ModelError(f"--model_name_or_path {name!r} is a file: give the model's directory, or a Hub model id.")
    elif looks_like_path(name):
        raise ModelError(f"Model directory not found: {name!r}. Check the path given to --model_name_or_path.")
    try:
        config = AutoConfig.from_pretrained(name)
    except OSError as error:
        if os.path.isdir(name):
            raise ModelError(f"Cannot read {os.path.join(name, 'config.json')}: {first_line(error)} Fix it, or use "
                             "the config.json that came with the model's weights.") from None
        raise ModelError(hub_problem(name, error)) from None
    except ValueError as error:  # an unknown model_type, a config transformers cannot build
        raise ModelError(f"--model_name_or_path {name!r}: {first_line(error)} shardtune plans and trains model_type "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}.") from None
    check_architecture(config, name)
    check_shape_fields(name)
    return config


def resolve_model(model: str) -> ModelShape:
    name, config = resolve_config(model)
    return shape_from_config(config, name)


def flops_per_token(shape: ModelShape, seq_len: int = DEFAULT_SEQ_LEN, recompute: bool = False,
                    adapters: int | None = None) -> float:
    """Training FLOPs per token, PaLM's definition (Chowdhery et al. 2022, appendix B).

    Model FLOPs: 6·N + 12·L·H·Q·T. N = non-embedding matmul parameters (input embedding excluded: a lookup;
    lm_head included); each of them costs 2 FLOPs per token in forward and 4 in backward. 12·L·H·Q·T is the
    attention score and value matmuls (QKᵀ and AV: 2·2·H·Q·T per layer forward, times 3 for forward+backward),
    with L layers, H query heads, Q head dim, T sequence length; counted without causal-mask savings, as PaLM does.
    A sliding-window layer (Gemma 3's local layers, Mistral's) attends min(window, T) positions in place of T.

    With `recompute=True` the hardware FLOPs (HFU) of full activation recomputation: the forward runs twice, so
    8·N + 16·L·H·Q·T. MFU never counts recomputation; HFU does.

    With a frozen base trained through `adapters` parameters (LoRA), the base's weights take no gradient: its
    backward computes the inputs' gradients alone, 2 FLOPs per parameter and token, so 4·N (6·N with
    recomputation), and 6 per adapter parameter (8 with recomputation); attention's backward is the same."""
    dense, attention = 6, 12
    if recompute:
        dense, attention = 8, 16
    attention_flops = attention * shape.heads * shape.head_dim * shape.attended_positions(seq_len)
    if adapters is not None:
        return (dense - 2) * shape.non_embedding_matmul_params + dense * adapters + attention_flops
    return dense * shape.non_embedding_matmul_params + attention_flops


def mfu(tokens_per_second_total: float, flops_per_token: float, num_gpus: int, peak: float) -> float:
    """Model FLOPs utilisation as a fraction: achieved model FLOP/s over the peak of all GPUs."""
    return tokens_per_second_total * flops_per_token / (num_gpus * peak)


def report(model: str, tokens_per_second: float, gpus: int, gpu: str | None, seq_len: int) -> dict:
    shape = resolve_model(model)
    per_token = flops_per_token(shape, seq_len)
    peak = peak_flops(gpu)
    achieved = tokens_per_second * per_token / gpus
    return {
        "model": shape.name, "params": shape.params, "non_embedding_matmul_params": shape.non_embedding_matmul_params,
        "seq_len": seq_len, "flops_per_token": per_token, "hfu_flops_per_token": flops_per_token(shape, seq_len, True),
        "tokens_per_second": tokens_per_second, "gpus": gpus, "gpu": gpu, "peak_flops_per_gpu": peak,
        "tflops_per_gpu": achieved / 1e12, "mfu": mfu(tokens_per_second, per_token, gpus, peak) if peak else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtune.models.flops",
                                     description=__doc__.strip().splitlines()[0])
    parser.add_argument("--model", required=True, help=f"Built-in ({', '.join(BUILTIN_MODELS)}), dir or recipe.")
    parser.add_argument("--tokens_per_second", type=float, required=True, help="All GPUs together.")
    parser.add_argument("--gpus", type=int, required=True, help="How many GPUs produced --tokens_per_second.")
    parser.add_argument("--gpu", default=None, help=f"{', '.join(PEAK_BF16_FLOPS)} or a torch device name, for the "
                                                    "MFU (default: none, no MFU).")
    parser.add_argument("--max_seq_length", type=int, default=DEFAULT_SEQ_LEN,
                        help="T in the attention term (default: %(default)s).")
    parser.add_argument("--json", action="store_true", help="Print the figures as one JSON object.")
    args = parser.parse_args(argv)
    problems = [f"--{name} must be > 0, got {value}." for name, value in (
        ("tokens_per_second", args.tokens_per_second), ("gpus", args.gpus), ("max_seq_length", args.max_seq_length))
        if not value > 0]
    for problem in problems:
        print(f"shardtune.models.flops: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    try:
        with warnings.catch_warnings(record=True) as caught:  # an unknown GPU: its line below, not a traceback's
            warnings.simplefilter("always")
            result = report(args.model, args.tokens_per_second, args.gpus, args.gpu, args.max_seq_length)
    except ValueError as error:
        print(f"shardtune.models.flops: error: {error}", file=sys.stderr)
        return 2
    for warning in caught:
        print(f"shardtune.models.flops: warning: {warning.message}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}: {result['flops_per_token']:.4g} FLOPs/token at T={args.max_seq_length} "
          f"(N = {result['non_embedding_matmul_params']:,} non-embedding matmul params)")
    print(f"{result['tflops_per_gpu']:.1f} TFLOP/s per GPU")
    if result["mfu"] is None:
        print("MFU: unknown GPU peak, not reported (give --gpu " + "|".join(PEAK_BF16_FLOPS) + ")")
    else:
        print(f"MFU: {100 * result['mfu']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

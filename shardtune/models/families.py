"""The decoder families shardtune plans and trains (dense, and the mixtures of experts of experts.py), each as data:
which parameters its layers hold beyond Llama's (biases, q/k norms, extra norms), what its logits pass through after
the LM head, and the levers it refuses, each in one line. Read from transformers 5.24's modeling_<family>.py and
liger-kernel 0.8.5's monkey_patch.py; the counts are held to the model built on the meta device by
tests/unit/models/test_models.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtune.models.experts import MOE_REFUSALS


@dataclass(frozen=True)
class Family:
    """One model_type's layer layout. Every family here has q, k, v and o projections over grouped-query heads, a
    gated MLP of three matrices (or a router and experts of them: shardtune.models.experts), RMSNorms and no position
    table."""

    model_type: str
    # "head": one weight of head_dim each for q and k, shared by the heads (Qwen3, Gemma 3); "width": over all
    # heads' width, q's heads x head_dim and k's kv_heads x head_dim (OLMo 2); "": none.
    qk_norm: str = ""
    layer_norms: int = 2  # hidden-size RMSNorms per layer: Gemma 3 has four (before and after attention and MLP)
    post_norms: bool = False  # OLMo 2 normalises the sublayers' outputs, not their inputs
    norm_scale_fp32: bool = False  # Gemma's RMSNorm scales by (1 + weight) in fp32, Llama's by weight in x's dtype
    qkv_bias: bool = False  # Qwen2: biases on q, k and v whatever the config says (others: attention_bias)
    liger_refusal: str = ""  # why --use_liger_kernel cannot run on the family ("" where it can)
    liger_options: dict = field(default_factory=lambda: {"swiglu": True})  # the MLP kernel's keyword in Liger
    liger_qk_norms: bool = True  # whether Liger's patch of a model instance replaces its q/k norms (OLMo 2's: no)
    tensor_parallel_refusal: str = ""  # why tensor parallelism cannot run ("" where it can)


# Measured on CPU (2 ranks, tp 2, against one process): transformers 5.24's plans for Qwen3 and Gemma 3 all-reduce
# the q/k norms' gradients on DTensors, which torch dispatches to no sharding strategy (NotImplementedError on
# c10d.allreduce_), and Gemma 3's tied head is not found where the split looks for it (KeyError 'lm_head.weight').
_QK_NORM_TP = ("transformers' tensor-parallel plan all-reduces the q/k norms' gradients as DTensors, which torch "
               "cannot run (NotImplementedError on c10d.allreduce_, measured on CPU): launch without "
               "parallelism_config_tp_size.")

FAMILIES = {family.model_type: family for family in (
    Family("llama"),
    Family("mistral"),
    Family("qwen2", qkv_bias=True),
    Family("qwen3", qk_norm="head", tensor_parallel_refusal=_QK_NORM_TP),
    Family("gemma3_text", qk_norm="head", layer_norms=4, norm_scale_fp32=True, liger_options={"geglu": True},
           liger_refusal="Liger's fused loss would run in place of Gemma 3's LM head without its final-logit "
                         "soft-capping, and its GeGLU and offset-RMSNorm kernels are not measured here: drop "
                         "--use_liger_kernel.",
           tensor_parallel_refusal="Gemma 3's tied LM head is not found where transformers' tensor-parallel split "
                                   "looks for it (KeyError 'lm_head.weight', measured on CPU), and its q/k norms' "
                                   "gradient all-reduce fails as Qwen3's: launch without parallelism_config_tp_size."),
    # OLMo 2's tensor-parallel plan gathers q, k and v whole on every rank (colwise_gather_output, for its norms
    # over all heads), which the tensor-parallel plan here does not count.
    Family("olmo2", qk_norm="width", post_norms=True, liger_qk_norms=False,
           tensor_parallel_refusal="OLMo 2's tensor-parallel plan gathers q, k and v whole on every rank for its "
                                   "q/k norms (colwise_gather_output), which the planner does not count: launch "
                                   "without parallelism_config_tp_size."),
    Family("smollm3"),
    Family("granite", liger_refusal="Liger's fused loss would run in place of Granite's LM head without dividing "
                                    "the logits by logits_scaling: drop --use_liger_kernel."),
    # Mixtures of experts (shardtune.models.experts): Qwen3-MoE's attention is Qwen3's, Mixtral's Mistral's.
    Family("qwen3_moe", qk_norm="head", liger_refusal=MOE_REFUSALS["liger"],
           tensor_parallel_refusal=MOE_REFUSALS["tensor_parallel"]),
    Family("mixtral", liger_refusal=MOE_REFUSALS["liger"], tensor_parallel_refusal=MOE_REFUSALS["tensor_parallel"]),
)}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
LIGER_MODEL_TYPES = tuple(name for name, family in FAMILIES.items() if not family.liger_refusal)
# Mixtures of experts whose layouts (shared experts, dense layers, other routers) the shape does not count.
MIXTURE_OF_EXPERTS_TYPES = ("qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")


def family_of(model_type: str) -> Family:
    return FAMILIES[model_type]


def layer_types(config: object) -> list[str]:
    """Each layer's attention kind as transformers builds it: the config's layer_types, else (Mistral, configs
    before layer_types) every layer sliding when sliding_window is set."""
    layers = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    if getattr(config, "model_type", "") in ("mistral", "mixtral") and getattr(config, "sliding_window", None):
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers

"""The public config.json values of the built-in models, as plain values: planning a built-in model needs no
transformers import (which pulls in torch and takes seconds). Each is built on the meta device by
tests/unit/models/test_models.py and its parameters counted against the shape's."""

from __future__ import annotations


def _llama3(hidden: int, inter: int, layers: int, heads: int, tied: bool, rope_factor: float) -> dict:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": rope_factor,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return dict(
        model_type="llama", vocab_size=128256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=tied, bos_token_id=128000, eos_token_id=128001,
    )


def _qwen3(hidden: int, inter: int, layers: int, heads: int) -> dict:
    return dict(
        model_type="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, attention_bias=False, bos_token_id=151643, eos_token_id=151645,
    )


def _sliding_every(layers: int, pattern: int) -> list[str]:
    """Gemma 3's layout as its config.json's sliding_window_pattern gives it: every `pattern`-th layer global."""
    return ["sliding_attention" if (index + 1) % pattern else "full_attention" for index in range(layers)]


BUILTIN_CONFIG_VALUES = {
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, tied=True, rope_factor=32.0),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, tied=True, rope_factor=32.0),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, tied=False, rope_factor=8.0),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64, tied=False, rope_factor=8.0),
    "llama-3.1-405b": _llama3(16384, 53248, 126, 128, tied=False, rope_factor=8.0),
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=4096,
        tie_word_embeddings=False,
    ),
    # Qwen2 puts biases on q, k and v (not on o): 3584 + 2 x 512 extra parameters per layer.
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
    ),
    # Qwen3: q/k RMSNorms over head_dim (128, apart from hidden / heads), no qkv bias.
    "qwen3-8b": _qwen3(4096, 12288, 36, 32),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64),
    # Gemma 3 12B's text model: 262k vocabulary tied and scaled by sqrt(hidden), four norms a layer, q/k norms,
    # five sliding-window layers (1024) to each global one.
    "gemma-3-12b": dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=131072,
        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=1024, layer_types=_sliding_every(48, 6),
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
    # OLMo 2 7B: norms after attention and MLP, q/k norms over all heads' width (4096 each).
    "olmo-2-7b": dict(
        model_type="olmo2", vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=None, eos_token_id=100257, pad_token_id=100277,
    ),
    # SmolLM3 3B: Llama's layers, every 4th without RoPE, tied embeddings.
    "smollm3-3b": dict(
        model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}, no_rope_layer_interval=4,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128012, pad_token_id=128004,
    ),
    # Granite 3.3 8B: Llama's layers, multipliers on the embedding, residuals, attention scores and logits.
    "granite-3.3-8b": dict(
        model_type="granite", vocab_size=49159, hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0}, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    ),
    # Qwen3-30B-A3B: Qwen3's attention (32 heads, 4 kv heads, head_dim 128, q/k norms), 128 experts of width 768
    # in every layer, 8 routed per token (norm_topk_prob), router_aux_loss_coef 0.001.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.001, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=151643, eos_token_id=151645,
    ),
    # Mixtral 8x7B: Mistral 7B's attention, 8 experts of width 14336 in every layer, 2 routed per token,
    # router_aux_loss_coef 0.02, no sliding window.
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ),
}
# Hub ids whose last path component, lower-cased, does not already equal a built-in name: Mistral's releases
# share one shape; Llama 3.3 70B is Llama 3.1 70B's architecture; the pretrained and instruction-tuned releases of
# the others share theirs.
ALIASES = {"mistral-7b-v0.1": "mistral-7b", "mistral-7b-v0.3": "mistral-7b", "llama-3.3-70b": "llama-3.1-70b",
           "gemma-3-12b-text": "gemma-3-12b", "olmo-2-1124-7b": "olmo-2-7b",
           "olmo-2-1124-7b-instruct": "olmo-2-7b", "olmo-2-1124-7b-sft": "olmo-2-7b", "qwen3-8b-base": "qwen3-8b",
           "smollm3-3b-base": "smollm3-3b", "granite-3.3-8b-base": "granite-3.3-8b",
           "granite-3.3-8b-instruct": "granite-3.3-8b", "qwen3-30b-a3b-base": "qwen3-30b-a3b",
           "mixtral-8x7b-v0.1": "mixtral-8x7b", "mixtral-8x7b-instruct-v0.1": "mixtral-8x7b"}

"""The tiny random config of each family that the CPU tests train: Llama's tiny sizes, plus what makes the family
differ exercised at that size (Gemma 3's sliding layers with a window shorter than the rows, SmolLM3's NoPE layer,
Granite's multipliers, the experts' routing)."""

from __future__ import annotations

TINY_SIZES = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_FAMILY_VALUES = {
    "llama": dict(rms_norm_eps=1e-5, rope_theta=10000.0),
    "mistral": dict(rms_norm_eps=1e-5, sliding_window=None),
    "qwen2": dict(rms_norm_eps=1e-6),
    "qwen3": dict(rms_norm_eps=1e-6, head_dim=24),  # head_dim apart from hidden / heads, as Qwen3's
    # One sliding layer (window 8, shorter than the tiny task's rows) before the global one; tied embeddings.
    "gemma3_text": dict(rms_norm_eps=1e-6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True),
    "olmo2": dict(rms_norm_eps=1e-6),
    "smollm3": dict(rms_norm_eps=1e-6, no_rope_layer_interval=2),  # the second layer without RoPE
    "granite": dict(rms_norm_eps=1e-6, embedding_multiplier=4.0, residual_multiplier=0.5,
                    attention_multiplier=0.125, logits_scaling=2.0),
    # Mixtures of experts: 4 experts of width 48, 2 routed per token, a load-balancing loss weight large enough
    # to move the routers within the tests' few steps.
    "qwen3_moe": dict(rms_norm_eps=1e-6, head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.1),
    "mixtral": dict(rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                    sliding_window=None, router_aux_loss_coef=0.1),
}


def tiny_config_values(model_type: str, vocab_size: int, **overrides) -> dict:
    """config.json values of the family's tiny model."""
    return TINY_SIZES | TINY_FAMILY_VALUES[model_type] | {"vocab_size": vocab_size} | overrides

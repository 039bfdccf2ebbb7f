"""The mixtures of experts shardtune plans and trains, as data: where each family's config.json keeps its expert
count, top-k and expert width, and the levers a mixture of experts refuses, each in one line. Read from
transformers 5.24's modeling_qwen3_moe.py and modeling_mixtral.py: every MoE layer holds a router (a linear map
of experts x hidden, no bias) and the experts' gated MLPs as two packed 3-D parameters, gate_up_proj (experts x
2·intermediate x hidden) and down_proj (experts x hidden x intermediate); each token runs its top-k experts; with
output_router_logits the model adds router_aux_loss_coef x the load-balancing loss of the routers' logits to its
loss (shardtune.models.routing trains and logs it)."""

from __future__ import annotations

# model_type -> (config attribute of the expert count, of the expert MLP's width). Qwen3-MoE keeps the dense
# MLP's width in intermediate_size beside the experts' moe_intermediate_size; Mixtral's experts are its MLPs.
EXPERT_FIELDS = {"qwen3_moe": ("num_experts", "moe_intermediate_size"),
                 "mixtral": ("num_local_experts", "intermediate_size")}
MOE_MODEL_TYPES = tuple(EXPERT_FIELDS)
# Parameters in the order a MoE layer's MLP registers them: Qwen3-MoE builds its experts before its router.
ROUTER_FIRST = {"qwen3_moe": False, "mixtral": True}

# Why each lever cannot run on a mixture of experts, measured or read on this install (docs/models.md).
SLICED_ROWS = ("the router's load-balancing loss is a function of a whole micro-batch's routing, which a rank "
               "holding a slice of each row cannot compute as one process does")
MOE_REFUSALS = {
    "tensor_parallel": "transformers' tensor-parallel plan for the experts (packed_colwise gate_up_proj, "
                       "moe_tp_experts) is not planned nor proven here: launch without parallelism_config_tp_size.",
    "sequence_split": f"{SLICED_ROWS}: launch without parallelism_config_sp_size.",
    "context_parallel": f"{SLICED_ROWS}: launch without parallelism_config_cp_size.",
    "liger": "Liger's patches replace the MoE block's forward with their own expert loop, whose router logits the "
             "load-balancing loss here does not see: drop --use_liger_kernel.",
    "fp8": "torchao's float8 training converts nn.Linear layers, and the experts (most of the weights) are packed "
           "3-D parameters it leaves in 16 bits, which the planner does not count: use --mixed_precision bf16.",
    "peft": "peft's all-linear adapts the router and the packed experts (its ParamWrapper over gate_up_proj and "
            "down_proj), adapters the planner does not count: train all the weights (drop --use_peft).",
    "selective": "--gradient_checkpointing_mode selective keeps a Llama layer's q, v, gate and down outputs by the "
                 "order of its matmuls, which a MoE layer's router and grouped expert matmuls do not follow: use "
                 "--gradient_checkpointing_mode full.",
    "compile": "the routers' logits are recorded by forward hooks around each micro-batch's forward "
               "(shardtune.models.routing), which compiled layers are not proven to keep: drop --torch_compile.",
    "dpo": "DPO's loss here leaves out the router's load-balancing loss that transformers adds to a mixture of "
           "experts' loss: train it with --method sft.",
}


def expert_sizes(config: object) -> tuple[int, int, int]:
    """(experts, top-k, the MLP width the shape plans) of a config or the plain values of a built-in shape: (0, 0,
    intermediate_size) for a dense model. Raises ValueError for a Qwen3-MoE whose layers are not all sparse
    (mlp_only_layers, decoder_sparse_step), whose dense layers the shape does not count."""
    model_type = getattr(config, "model_type", "")
    if model_type not in EXPERT_FIELDS:
        return 0, 0, config.intermediate_size
    count_key, width_key = EXPERT_FIELDS[model_type]
    experts = getattr(config, count_key, None) or getattr(config, "num_experts", None)
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if dense or step != 1:
        raise ValueError(f"This {model_type} model mixes dense layers among its expert layers (mlp_only_layers "
                         f"{dense}, decoder_sparse_step {step}), which shardtune does not plan: give a model whose "
                         "every layer holds experts (mlp_only_layers [], decoder_sparse_step 1).")
    return int(experts), int(config.num_experts_per_tok), int(getattr(config, width_key))


def router_aux_loss_coef(config: object) -> float:
    """The weight of the load-balancing loss in the trained loss, as the model's forward adds it."""
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def is_mixture_of_experts(config: object) -> bool:
    return getattr(config, "model_type", "") in EXPERT_FIELDS

"""A mixture of experts' router loss, trained as transformers' model trains it and logged apart.

With output_router_logits, transformers' Qwen3-MoE and Mixtral forwards add router_aux_loss_coef x
load_balancing_loss_func(every router's logits, experts, top-k, attention_mask) to the micro-batch's loss. The
trainer computes its loss outside the forward (shardtune.step: FSDP2's output cast would round a returned loss),
so the routers' logits are captured here by a forward hook on each router, as transformers' own OutputRecorder
captures them, and the loss is computed by the model's own load_balancing_loss_func. Each micro-batch's loss is
one term of the mean over the global batch's micro-batches, as transformers' Trainer averages a model's loss
over accumulation steps and ranks; the cross-entropy stays the global batch's token mean (shardtune.step).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shardtune.models.experts import is_mixture_of_experts, router_aux_loss_coef


def router_class(model: torch.nn.Module) -> type[torch.nn.Module]:
    """The module class whose first output transformers records as router_logits."""
    return type(model)._can_record_outputs["router_logits"].target_class


@contextmanager
def routers_recorded(model: torch.nn.Module) -> Iterator[list[torch.Tensor] | None]:
    """Each router's logits (tokens x experts) of the forwards run inside, in layer order; None for a dense model.
    Only inside: a recomputed layer's router runs again in the backward, outside."""
    if not is_mixture_of_experts(model.config):
        yield None
        return
    logits: list[torch.Tensor] = []
    kind = router_class(model)
    handles = [module.register_forward_hook(lambda _module, _inputs, output: logits.append(output[0]))
               for module in model.modules() if isinstance(module, kind)]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


def load_balancing_loss(model: torch.nn.Module, logits: list[torch.Tensor], attention_mask: torch.Tensor | None
                        ) -> torch.Tensor:
    """transformers' own load-balancing loss of the model's family over the recorded logits (read from the router's
    module: FSDP2 makes the model's class one of its own)."""
    modeling = sys.modules[router_class(model).__module__]
    config = model.config
    return modeling.load_balancing_loss_func(tuple(logits), config.num_experts, config.num_experts_per_tok,
                                             attention_mask)


def routed_tokens(model: torch.nn.Module, logits: list[torch.Tensor], attention_mask: torch.Tensor | None
                  ) -> torch.Tensor:
    """Per expert, the tokens routed to it summed over the layers (each token counts once per layer and expert it
    is routed to; padding not at all), as float64 on the logits' device: no sync."""
    config = model.config
    with torch.no_grad():
        chosen = torch.stack([torch.topk(torch.softmax(layer.float(), dim=-1), config.num_experts_per_tok,
                                         dim=-1).indices for layer in logits])  # layers x tokens x top-k
        weights = torch.ones(chosen.shape[1], dtype=torch.float64, device=chosen.device)
        if attention_mask is not None:
            weights = attention_mask.reshape(-1).to(device=chosen.device, dtype=torch.float64)
        weights = weights[None, :, None].expand(chosen.shape).reshape(-1)
        counts = torch.zeros(config.num_experts, dtype=torch.float64, device=chosen.device)
        return counts.scatter_add_(0, chosen.reshape(-1), weights)


def with_router_loss(model: torch.nn.Module, loss: torch.Tensor, logits: list[torch.Tensor] | None, batch: dict,
                     micro_batches: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The micro-batch's loss share plus coef x its load-balancing loss / the global batch's micro-batches, and
    [that load-balancing share, tokens routed per expert...] for the metrics (None for a dense model)."""
    if logits is None:
        return loss, None
    mask = batch.get("attention_mask")
    aux = load_balancing_loss(model, logits, mask) / micro_batches
    routed = routed_tokens(model, logits, mask)
    loss = loss + router_aux_loss_coef(model.config) * aux.to(loss.device)
    return loss, torch.cat([aux.detach().to(torch.float64).reshape(1), routed])

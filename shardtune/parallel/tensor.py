"""Tensor parallelism: every decoder layer's matmuls split over the tp ranks of a group, on transformers' own plan
for the model (Llama's: q, k, v, gate and up projections column-wise, o and down projections row-wise, the LM head
column-wise with its output gathered, and the embedding split over the vocabulary: Llama's base_model_tp_plan names
no embedding, and transformers 5.24 adds `embed_tokens: embedding_rowwise` to any model whose plan is not empty,
distributed/mixin.py init_parallel_plans; 5.17 adds none and has no _resolve_parallel_plans: TP needs 5.24,
check_tensor_parallel_heads), over the tp axis of the device mesh accelerate builds from the launch's
parallelism_config ([dp_replicate, dp_shard, tp], tp innermost: a group is consecutive ranks, the GPUs of one
node). FSDP2 shards what each rank holds over the dp_shard axis.

How the trainer drives it:
- Loading. Under FSDP's RAM-efficient loading (fsdp_cpu_ram_efficient_loading, fsdp_tp.yaml's) rank 0 alone
  reads the weights and the others build the model on the meta device; rank 0 sets its whole state dict aside
  and empties its model too (rank0_full_state), every rank splits and shards the meta model, and rank 0's tensors
  are broadcast one at a time into each rank's (dp_shard, tp) shard (shard_and_fill: accelerate's
  fsdp2_load_full_state_dict, which distributes each whole tensor by the 2-D placements). Host RAM per node is one
  full copy, rank 0's. Without it every rank loads the model, then keeps its slice of each planned weight
  (apply_tensor_parallel). transformers' own tensor-parallel loading (from_pretrained's
  DistributedConfig(tp_size=N)) builds a mesh of its own over the whole world (distributed/utils.py
  initialize_distributed_mesh): it cannot load onto accelerate's tp axis beside a dp_shard axis, and 5.24's
  from_pretrained reads a device_mesh argument for nothing but placing missing weights.
- Data. The ranks of a group run the same micro-batches: accelerate's prepared loaders deal rows to world / tp data
  ranks (data_loader.py prepare_data_loader reads the mesh's tp size). The data-parallel degree is world / tp.
- Loss. Every rank of a group computes the same loss over the global batch's targets; the loss, token counts and
  eval statistics are counted once per group (its first rank's, shardtune.parallel.groups). transformers'
  sequence parallelism is not wired (DistributedConfig.enable_sequence_parallel), so norms, layer inputs and
  logits are whole on every tp rank, the logits gathered by the head.
- Gradients. DTensor's backward sums each split matmul's partial gradients inside the group; FSDP2 averages over
  the data ranks, so the step scales the loss by accumulation x (world / tp).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from shardtune.config import ConfigError, Recipe

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig, PreTrainedModel


def tensor_parallel_size(accelerator: Accelerator) -> int:
    """The ranks each layer is split over in the run (1 without TP)."""
    config = accelerator.parallelism_config
    return config.tp_size if config is not None and config.tp_enabled else 1


def apply_tensor_parallel(model: PreTrainedModel, mesh: DeviceMesh) -> None:
    """Split the loaded `model` over the tp `mesh` on transformers' plan for it, as from_pretrained does with a
    DistributedConfig (distributed/mixin.py maybe_distribute_model: the plan resolved, then applied), and replicate
    the parameters the plan leaves whole (replicate_unplanned). Each rank keeps its own slice of the weights it
    loaded: no communication."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    config = DistributedConfig(tp_size=mesh.size())
    plan, _, _ = model._resolve_parallel_plans(config)
    apply_tensor_parallelism(model, mesh, plan)
    model.config.distributed_config = config  # where accelerate reads the model's tp size (get_model_tp_size)
    replicate_unplanned(model, mesh)


def rank0_full_state(model: torch.nn.Module, main_process: bool) -> dict[str, torch.Tensor]:
    """Before the split, under RAM-efficient loading: rank 0's whole weights set aside (its state dict; empty on
    the other ranks, whose models are on the meta device already) and rank 0's parameters moved to the meta device,
    so that every rank splits and shards the same empty model (shard_and_fill fills it). Accelerate's own fill
    would read the state dict after the split: rank 0's slices, not the whole weights. The buffers stay (rotary
    frequencies, computed, as on the meta ranks); a parameter shared by two modules (tied embeddings) stays
    shared."""
    import torch

    if not main_process:
        return {}
    full = model.state_dict()  # holds the loaded tensors: one copy, rank 0's, until the fill has sent them
    empty: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in empty:
                    empty[id(param)] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                module._parameters[name] = empty[id(param)]
    return full


def shard_and_fill(accelerator: Accelerator, model: PreTrainedModel, full: dict[str, torch.Tensor]
                   ) -> PreTrainedModel:
    """FSDP2's sharding of the split meta `model` (accelerate's fsdp2_prepare_model, its own rank-0 fill held off),
    then rank 0's whole tensors `full` (rank0_full_state) broadcast one at a time and cut by every rank into its
    (dp_shard, tp) DTensor shard (accelerate's fsdp2_load_full_state_dict: distribute_tensor with each
    parameter's 2-D placements). A collective: every rank calls it."""
    from accelerate.utils import fsdp2_load_full_state_dict, fsdp2_prepare_model
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = accelerator.state.fsdp_plugin
    plugin.cpu_ram_efficient_loading = False  # the model is on the meta device already; the fill is below
    try:
        model = fsdp2_prepare_model(accelerator, model)
    finally:
        plugin.cpu_ram_efficient_loading = True
    fsdp2_load_full_state_dict(accelerator, model, full, cpu_offload=isinstance(plugin.cpu_offload, CPUOffloadPolicy))
    full.clear()
    model.tie_weights()  # loading by assignment replaced the shared parameter by two
    return model


def replicate_unplanned(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """The parameters no rule splits (the norms) as DTensors replicated over the tp `mesh`, their modules taking
    and returning plain tensors: every gradient is then a DTensor of one mesh, which gradient clipping's norm
    needs (torch stacks the per-parameter norms). accelerate's own replication (accelerator.py `_prepare_tp`)
    imports transformers' ReplicateParallel, which 5.24 no longer has."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    def to_replicated(_module: torch.nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(value, device_mesh, [Replicate()], run_check=False)
                     if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) else value
                     for value in inputs)

    def to_local(_module: torch.nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    def replicated(_name: str, module: torch.nn.Module, device_mesh: DeviceMesh) -> None:
        # Each rank's own values (src_data_rank None): equal on every rank, or meta under rank-0 loading, where
        # torch's default broadcast from the group's first rank has no data to send.
        for key, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                module.register_parameter(key, torch.nn.Parameter(
                    distribute_tensor(param.data, device_mesh, [Replicate()], src_data_rank=None),
                    requires_grad=param.requires_grad))

    for module in list(model.modules()):
        if any(not isinstance(param, DTensor) for param in module.parameters(recurse=False)):
            distribute_module(module, mesh, partition_fn=replicated, input_fn=to_replicated, output_fn=to_local)


@contextmanager
def prepare_without_tp(accelerator: Accelerator) -> Iterator[None]:
    """accelerate's `prepare` with the tp axis hidden: the model is already split and sharded, and under FSDP2 its
    `_prepare_tp` would import transformers' ReplicateParallel (accelerator.py, 1.15), gone from transformers 5.24.
    The loaders are prepared by the mesh, which keeps its tp axis."""
    config = accelerator.parallelism_config
    size = tensor_parallel_size(accelerator)
    if size == 1 or not accelerator.is_fsdp2:
        yield
        return
    config._set_size("tp", 1)
    try:
        yield
    finally:
        config._set_size("tp", size)


def check_tensor_parallel(recipe: Recipe, tp_size: int, given: frozenset[str] = frozenset()) -> None:
    """What TP cannot run with yet: the levers that swap or rewrite the LM head and the linear layers that
    transformers' plan splits."""
    if tp_size == 1:
        return
    problems = []
    if recipe.method == "dpo":
        problems.append(f"--method dpo under tensor parallelism (tp_size {tp_size}) is not wired: DPO's log-probs run "
                        "as the LM head's forward, which TP wraps. Use an FSDP or DeepSpeed config without "
                        "parallelism_config_tp_size.")
    if "chunked_cross_entropy" in given and recipe.chunked_cross_entropy:
        problems.append(f"--chunked_cross_entropy true under tensor parallelism (tp_size {tp_size}): the tiled loss "
                        "runs as the LM head's forward, which TP wraps with its output gathered; the run computes "
                        "the plain loss. Remove the flag.")
    levers = {"--use_peft true": recipe.use_peft, "--use_liger_kernel true": recipe.use_liger_kernel,
              "--mixed_precision fp8": recipe.mixed_precision == "fp8"}
    for flag in [flag for flag, on in levers.items() if on]:
        problems.append(f"{flag} under tensor parallelism (tp_size {tp_size}) is not wired: it replaces the layers "
                        "that TP splits. Remove it, or launch without parallelism_config_tp_size.")
    # torch 2.13's dynamo recurses without end through transformers' TP wrappers (measured on CPU, aot_eager);
    # TRL's activation offloader has not run on DTensor activations.
    unproven = {"--torch_compile true": recipe.torch_compile, "--activation_offloading true":
                recipe.activation_offloading}
    for flag in [flag for flag, on in unproven.items() if on]:
        problems.append(f"{flag} under tensor parallelism (tp_size {tp_size}) is not supported yet: remove it, or "
                        "launch without parallelism_config_tp_size.")
    if problems:
        raise ConfigError(problems)


def check_tensor_parallel_heads(config: PretrainedConfig, tp_size: int) -> None:
    """Each rank of a group computes whole attention heads: tp must divide the heads and the key/value heads."""
    if tp_size == 1:
        return
    from transformers import PreTrainedModel, __version__

    if not hasattr(PreTrainedModel, "_resolve_parallel_plans"):  # 5.17's split takes no plan and keeps the embedding
        raise ConfigError(f"tensor parallelism splits the model on the plan transformers 5.24 resolves (the pinned "
                          f"version; its embedding split over the vocabulary); transformers {__version__} has no "
                          "such plan: pip install -r requirements.txt, or launch without parallelism_config_tp_size.")
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):  # the supported families all have one; a new one may not
        raise ConfigError(f"transformers has no tensor-parallel plan for {text.model_type} models "
                          "(its config's base_model_tp_plan is empty): launch without parallelism_config_tp_size.")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % tp_size:
            raise ConfigError(f"The model has {count} {what}, which tp_size {tp_size} does not divide: each rank "
                              f"computes whole heads. Set parallelism_config_tp_size to a divisor of {count}.")



def checked_tensor_parallel(sizes: Mapping[str, int], world_size: int, uses_fsdp: bool, uses_deepspeed: bool) -> int:
    """The tp_size of the launch's parallelism_config `sizes` (accelerate's names: dp_replicate, dp_shard, tp),
    refused where accelerate or the trainer cannot run it: under DeepSpeed; beside DDP replicas (accelerate's
    ParallelismConfig refuses TP with dp_replicate alone); under FSDP2 without a dp_shard axis (accelerate's
    _validate_accelerator refuses it: TP alone runs under a DDP config). FSDP's rank-0 loading runs
    (shard_and_fill)."""
    tp, shard, replicate = sizes["tp"], sizes["dp_shard"], sizes["dp_replicate"]
    fix = ("launch accelerate_configs/fsdp_tp.yaml with --parallelism_config_tp_size <GPUs per node> "
           "--parallelism_config_dp_shard_size <processes / tp_size>")
    if uses_deepspeed:
        raise ConfigError(f"The accelerate config's parallelism_config sets tp_size {tp} under DeepSpeed: shardtune "
                          f"runs tensor parallelism under FSDP2 only: {fix}.")
    if tp < 1 or world_size % tp:
        raise ConfigError(f"parallelism_config_tp_size {tp} does not divide the {world_size} processes launched into "
                          f"groups: {fix}.")
    if not uses_fsdp and (tp != world_size or shard * replicate != 1):
        raise ConfigError(f"parallelism_config_tp_size {tp} under a DDP config over {world_size} processes: "
                          "accelerate runs tensor parallelism without FSDP2 only over every process (no data "
                          f"parallelism beside it): give tp_size {world_size}, or {fix}.")
    if replicate > 1:
        raise ConfigError(f"parallelism_config_dp_replicate_size {replicate} beside tp_size {tp}: hybrid sharding "
                          f"with tensor parallelism is not wired (nor tested); {fix}.")
    if uses_fsdp and shard < 2:
        raise ConfigError(f"parallelism_config_tp_size {tp} under FSDP2 with dp_shard_size {shard}: accelerate "
                          "needs a dp_shard axis for FSDP2 to shard over; for tensor parallelism alone launch "
                          f"accelerate_configs/ddp.yaml with --parallelism_config_tp_size <processes>, or {fix}.")
    if uses_fsdp and replicate * shard * tp != world_size:
        raise ConfigError(f"parallelism_config dp_replicate_size {replicate} x dp_shard_size {shard} x tp_size {tp} "
                          f"is not the {world_size} processes launched: {fix}.")
    return tp

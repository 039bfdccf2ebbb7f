"""The fastest plan that fits: every shipped accelerate config, checkpointing (off, selective, full) and micro-batch
in speed order (those the run fixes held), and when nothing fits, what binds and the fewest nodes on which something
does."""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shardtune.models.families import FAMILIES
from shardtune.models.flops import ModelShape
from shardtune.plan.hardware import Hardware
from shardtune.plan.planner import MemoryPlan, gb, plan
from shardtune.plan.report import checkpointing_words, optimizer_words, plan_checkpointing_words
from shardtune.plan.states import Peft
from shardtune.plan.strategy import CONFIGS_DIR, Strategy, read_accelerate_config
from shardtune.plan.tensor import tensor_parallel_problems

# Fastest first: least sharding, then offload. On several nodes hybrid sharding (the states sharded within a node:
# only the gradients' all-reduce crosses nodes) comes before ZeRO++ hpZ (the layers gathered within the node from a
# second copy of the weights), and both before sharding over every GPU; on one node they are skipped (the same as
# fsdp_full_shard, and ds_zero3 with a second copy). The sequence split (Ulysses) comes after ZeRO-3 alone: it adds
# two all-to-alls of q, k, v and the attention output per layer, and is planned where the rows are too long for
# one GPU's activations. Context parallelism (fsdp_cp, torch's ring attention, its key/value chunks passed around
# the GPUs of a node in every layer) comes after tensor parallelism: the last GPU-only axis, for rows that neither
# fits. Among offloads DeepSpeed's SIMD CPU Adam is faster than FSDP's
# CPU-side torch AdamW step, and NVMe is slowest. Tensor parallelism (fsdp_tp: each layer split over a node's GPUs,
# FSDP2 over the nodes) comes after every GPU-only config without it, and before offload: its all-reduces of every
# layer's activations stay within a node's NVLink, where offload moves the states over PCIe every step.
SPEED_ORDER = (
    "ddp", "ds_zero1", "fsdp_shard_grad_op", "ds_zero2", "fsdp_hybrid_shard", "ds_zero3_hpz", "fsdp_full_shard",
    "ds_zero3", "ds_zero3_ulysses", "fsdp_cp", "fsdp_tp",
    "ds_zero3_offload_optimizer", "ds_zero3_offload_optimizer_ulysses", "ds_zero3_cpu_offload",
    "fsdp_full_shard_cpu_offload", "ds_zero3_nvme_offload",
)
# The optimizers the search steps down before it offloads, (--optim, --bf16_stochastic_round): each trades precision
# for memory, so a run takes the first that fits. torch's AdamW over the fp32 master; torchao's 8-bit states over
# it; 8-bit states and bf16 weights and gradients without a master; 4-bit states without a master. DeepSpeed
# steps its own fp32 master with torch's AdamW only, and the rounding needs FSDP2 or one process (runs_under).
OPTIMIZER_LADDER = (("adamw_torch", False), ("adamw_torch_8bit", False), ("adamw_torch_8bit", True),
                    ("adamw_torch_4bit", True))
# Context parallelism is planned for long rows only: each GPU's chunk must keep its attention and matmuls busy
# while FSDP2 gathers the whole model's weights for every micro-batch (data parallelism's traffic for fewer tokens)
# and the key/value chunks go round the ring. torchtitan measures it from 32k-token rows on 8 GPUs: 4,096 per GPU.
CONTEXT_MIN_POSITIONS = 4096
MAX_NODES = 64  # how far "nothing fits" looks for a node count that does
MAX_MICRO_BATCH = 64  # the largest micro-batch searched (powers of two)
PROGRESS_EVERY_S = 5.0  # a search over node counts says where it is on stderr at most this often


def config_paths(configs_dir: str = CONFIGS_DIR) -> list[str]:
    """Every YAML in the directory, fastest first (SPEED_ORDER), unknown names last."""
    paths = glob.glob(os.path.join(configs_dir, "*.yaml"))
    rank = {name: index for index, name in enumerate(SPEED_ORDER)}
    return sorted(paths, key=lambda p: (rank.get(os.path.splitext(os.path.basename(p))[0], len(rank)), p))


def data_parallel(hardware: Hardware, strategy: Strategy) -> int:
    """The ranks that run their own rows: every GPU, or under tensor or context parallelism one per group."""
    return max(1, hardware.world_size // (strategy.tensor_parallel * strategy.context_parallel))


def keeps_batch(search: Search, hardware: Hardware) -> bool:
    """Whether some micro-batch keeps the global batch over the GPUs, or over one rank per node (tensor
    parallelism within the node)."""
    return any(micro_batches(search.global_batch, ranks, search.micro_batch)
               for ranks in {hardware.world_size, hardware.nodes})


@dataclass(frozen=True)
class Search:
    """The run a search plans: what every candidate shares, and the micro-batch and checkpointing it holds fixed
    (None: searched). `global_batch` None keeps no global batch (accumulation 1)."""

    global_batch: int | None = None
    seq: int = 4096
    mixed_precision: str = "bf16"
    configs_dir: str = CONFIGS_DIR
    attn: str = "sdpa"
    peft: Peft | None = None
    packing: bool = False
    micro_batch: int | None = None
    checkpointing: bool | None = None
    eval_batch: int = 8
    async_save: bool = False
    save_only_model: bool = False
    # The levers a recipe sets; the search plans them as given (the tiled loss is the recipe's default).
    chunked_cross_entropy: bool = True
    # None: searched, selective before full (a recipe holds its own).
    checkpointing_mode: str | None = None
    activation_offloading: bool = False
    # None: searched down OPTIMIZER_LADDER (a recipe holds its own).
    optim: str | None = None
    bf16_stochastic_round: bool | None = None
    # CUDA only, planned as given like activation offloading; it rules out selective checkpointing (its RoPE).
    use_liger_kernel: bool = False
    # Every k-th layer recomputed where the search recomputes: the recipe's, held (1: every layer).
    checkpointing_interval: int = 1
    # --method dpo: its reference mode (shardtune.config.reference_mode), held; None: SFT.
    reference: str | None = None
    # The shape of the model --ref_model_name_or_path names (None: the policy's), as plan() takes it.
    reference_shape: ModelShape | None = None

    def fixed(self) -> str:
        """What the search holds as given, in words: '' when it varies all of it."""
        held = [f"micro-batch {self.micro_batch}"] if self.micro_batch is not None else []
        if self.checkpointing is not None:
            held.append(f"gradient checkpointing {checkpointing_words(self.checkpointing, self.checkpointing_mode)}")
        elif self.checkpointing_mode is not None:
            held.append(f"checkpointing mode {self.checkpointing_mode}")
        if self.optim is not None or self.bf16_stochastic_round is not None:
            held.append("optimizer " + " or ".join(optimizer_words(*pair) for pair in self.optimizers()))
        return " and ".join(held)

    def optimizers(self) -> list[tuple[str, bool]]:
        """(optim, bf16_stochastic_round) pairs in OPTIMIZER_LADDER's order; the fixed ones alone."""
        ladder = [pair for pair in OPTIMIZER_LADDER if (self.optim is None or pair[0] == self.optim) and (
            self.bf16_stochastic_round is None or pair[1] == self.bf16_stochastic_round)]
        return ladder or [(self.optim or "adamw_torch", bool(self.bf16_stochastic_round))]

    def recomputations(self) -> list[tuple[bool, str]]:
        """(checkpointing, mode) pairs in speed order: none; selective, which recomputes only the cheap ops between
        the saved matmul and attention outputs; full, which recomputes the whole layer. The fixed ones alone; with
        activation offloading, which needs it, recomputation only."""
        modes = ("selective", "full") if self.checkpointing_mode is None else (self.checkpointing_mode,)
        if self.use_liger_kernel and self.checkpointing_mode is None:
            modes = ("full",)
        pairs = [(False, "full")] * (not self.activation_offloading) + [(True, mode) for mode in modes]
        return [pair for pair in pairs if self.checkpointing is None or pair[0] == self.checkpointing]




@dataclass
class Recommendation:
    plan: MemoryPlan | None
    gpu_only: bool
    accumulation: int | None
    message: str


def micro_batches(global_batch: int | None, world: int, fixed: int | None = None,
                  limit: int = MAX_MICRO_BATCH) -> list[tuple[int, int]]:
    """(micro, accumulation) pairs, largest micro first, that keep global = micro x accumulation x world: the
    powers of two up to `limit`, or the `fixed` micro-batch alone."""
    micros = [fixed] if fixed is not None else [2**power for power in range(limit.bit_length())][::-1]
    if global_batch is None:
        return [(micro, 1) for micro in micros]
    return [(micro, global_batch // (micro * world)) for micro in micros if global_batch % (micro * world) == 0]


def candidates(shape: ModelShape, hardware: Hardware, search: Search) -> Iterator[tuple[MemoryPlan, int, bool]]:
    """(plan, accumulation, offloads) for every config, checkpointing and micro-batch, fastest first: GPU-only
    configs before offload; within each, by optimizer (Search.optimizers), the configs without a sequence split
    before those with one; within each, no recomputation, then selective,
    then full (Search.recomputations),
    configs in SPEED_ORDER, then the largest micro-batch that keeps the global batch (accumulation derived; it
    must divide). A micro-batch or checkpointing the search fixes is the only one tried."""
    strategies = [strategy for strategy in (read_accelerate_config(path, search.mixed_precision)
                                            for path in config_paths(search.configs_dir))
                  if hardware.nodes > 1 or not strategy.multi_node_layout]
    # Recomputation (selective a few per cent more compute, full ~1/3 more) costs more than sharding on NVLink,
    # offload more than both. The sequence split is for rows too long for one GPU: tried once nothing unsplit fits
    # under the same optimizer, tensor parallelism after it, context parallelism last. Precision is traded (the
    # optimizer ladder) only where no exact run fits.
    for offload in (False, True):
        for optim, stochastic in search.optimizers():
            for axis in ("data", "sequence", "tensor", "context"):
                group = [s for s in strategies if s.offloads == offload and parallel_axis(s) == axis]
                yield from planned_group(shape, hardware, search, group, optim, stochastic, offload)


def parallel_axis(strategy: Strategy) -> str:
    """"tensor" (layers split), "sequence" (rows split by Ulysses), "context" (rows split by the ring attention)
    or "data" (none of them)."""
    if strategy.tensor_parallel > 1:
        return "tensor"
    return "sequence" if strategy.sequence_split > 1 else "context" if strategy.context_parallel > 1 else "data"


def planned_group(shape: ModelShape, hardware: Hardware, search: Search, group: list[Strategy],
                  optim: str, stochastic: bool, offload: bool) -> Iterator[tuple[MemoryPlan, int, bool]]:
    """candidates' plans of one group of configs under one optimizer: no recomputation, then selective, then full,
    the configs in SPEED_ORDER, the largest micro-batch that keeps the global batch over the data-parallel ranks
    first."""
    for checkpointing, mode in search.recomputations():
        if checkpointing and mode == "selective" and shape.experts:
            continue  # refused on a mixture of experts (shardtune.models.experts)
        for strategy in group:
            if not runs_under(strategy, hardware, search, optim, stochastic, shape):
                continue
            pairs = micro_batches(search.global_batch, data_parallel(hardware, strategy), search.micro_batch)
            for micro, accumulation in pairs:
                yield (plan(shape, hardware, strategy, micro, search.seq, checkpointing, search.attn, search.peft,
                            search.packing, async_save=search.async_save, save_only_model=search.save_only_model,
                            eval_batch=search.eval_batch, checkpointing_mode=mode,
                            activation_offloading=search.activation_offloading,
                            chunked_cross_entropy=search.chunked_cross_entropy, optim=optim,
                            bf16_stochastic_round=stochastic, use_liger_kernel=search.use_liger_kernel,
                            checkpointing_interval=search.checkpointing_interval, reference=search.reference,
                            reference_shape=search.reference_shape),
                       accumulation, offload)


def runs_under(strategy: Strategy, hardware: Hardware, search: Search, optim: str, stochastic: bool,
               shape: ModelShape | None = None) -> bool:
    """Whether the trainer runs this optimizer under `strategy` (checks.values.check_optimizer refuses the
    rest): DeepSpeed with torch's AdamW alone; the rounding over bf16 full fine-tuning, under FSDP2 sharded
    over every GPU or one process (replicas would round apart: DDP's, hybrid sharding's); activation offloading
    not beside DeepSpeed's offload (checks.check_activation_offloading); and a sequence split where the trainer
    runs one (split_runs), never under DPO; tensor parallelism where the launch and the trainer run it
    (plan.tensor.tensor_parallel_problems), one group per node at most (its all-reduces stay on NVLink)."""
    if not family_allows(strategy, search, shape):
        return False
    if strategy.tensor_parallel > 1 and (
            hardware.gpus_per_node % strategy.tensor_parallel or tensor_parallel_problems(
                strategy, shape, hardware.world_size, search.peft, search.reference, search.use_liger_kernel)):
        return False
    if strategy.sequence_split > 1 and not split_runs(strategy.sequence_split, hardware, search, shape):
        return False
    if strategy.split_positions > 1 and search.reference:
        return False  # DPO's step is not wired for the split (shardtune.methods.checks refuses it)
    if strategy.context_parallel > 1 and not context_runs(strategy.context_parallel, hardware, search):
        return False
    if strategy.float8 and (not strategy.takes_float8 or search.peft is not None):
        return False  # --mixed_precision fp8: full fine-tuning under FSDP2 without offload or DDP (check_fp8)
    if search.activation_offloading and strategy.kind == "deepspeed" and strategy.offloads:
        return False  # check_activation_offloading
    if strategy.kind == "deepspeed":
        return (optim, stochastic) == ("adamw_torch", False)
    if stochastic:
        unreplicated = strategy.kind == "fsdp" and strategy.sharded_over(hardware.world_size) == hardware.world_size
        return search.mixed_precision == "bf16" and search.peft is None and (
            unreplicated or hardware.world_size == 1)
    return True


def family_allows(strategy: Strategy, search: Search, shape: ModelShape | None) -> bool:
    """Whether the model's family takes the strategy's axis (shardtune.checks.model.check_family_levers and
    shardtune.parallel.context refuse the rest): tensor parallelism where the family's plan is planned and proven;
    no ring attention over sliding-window layers; Ulysses over windows shorter than the row only under flash
    attention, which reads the window from the layer rather than from the mask Ulysses drops; a mixture of
    experts under no split of its rows and no float8 (shardtune.models.experts)."""
    if shape is None:
        return True
    if strategy.tensor_parallel > 1 and FAMILIES[shape.family].tensor_parallel_refusal:
        return False
    if shape.experts and (strategy.sequence_split > 1 or strategy.context_parallel > 1 or strategy.float8
                          or search.peft is not None):
        return False  # a slice of the rows cannot compute the router's loss; float8, LoRA miss experts (experts.py)
    if strategy.context_parallel > 1 and shape.sliding_layers:
        return False
    windowed = shape.sliding_layers and 0 < shape.sliding_window < search.seq
    return not (strategy.sequence_split > 1 and windowed and search.attn != "flash")


def split_runs(split: int, hardware: Hardware, search: Search, shape: ModelShape | None) -> bool:
    """Whether a sequence split over `split` GPUs trains here (shardtune.parallel.sequence refuses the rest): it
    divides the GPUs, the length and the model's heads, and it meets no packed row under SDPA (whose dropped
    mask would let the row's sequences attend to each other)."""
    heads_divide = shape is None or (shape.heads % split == 0 and (shape.kv_heads % split == 0
                                                                    or split % shape.kv_heads == 0))
    return hardware.world_size % split == 0 and search.seq % split == 0 and heads_divide and \
        search.attn in ("sdpa", "flash") and not (search.packing and search.attn != "flash")


def context_runs(cp: int, hardware: Hardware, search: Search) -> bool:
    """Whether context parallelism over `cp` GPUs trains here (shardtune.parallel.context refuses the rest) and is
    worth planning: within a node, on a length of two chunks per GPU, under SDPA, without packing or Liger, and on
    rows of at least CONTEXT_MIN_POSITIONS positions per GPU."""
    return hardware.gpus_per_node % cp == 0 and search.seq % (2 * cp) == 0 and search.attn == "sdpa" and \
        not search.packing and not search.use_liger_kernel and search.seq >= CONTEXT_MIN_POSITIONS * cp


def recommend(shape: ModelShape, hardware: Hardware, search: Search | None = None) -> Recommendation:
    """The fastest plan that fits the GPUs and the host RAM (see `candidates` for the order); when none does,
    what binds and the smallest number of such nodes on which one does."""
    search = search or Search()
    if not keeps_batch(search, hardware):
        per = f"micro-batch {search.micro_batch} x " if search.micro_batch is not None else ""
        return Recommendation(None, False, None, f"Global batch {search.global_batch} is not divisible by {per}the "
                              f"{hardware.world_size} GPUs of {hardware.name}: no micro-batch keeps it.")
    for candidate, accumulation, offload in candidates(shape, hardware, search):
        if candidate.fits:
            return Recommendation(candidate, not offload, accumulation,
                                  _fit_message(candidate, accumulation, offload, shape, hardware, search))
    return Recommendation(None, False, None, nothing_fits(shape, hardware, search))


def describe_plan(p: MemoryPlan, accumulation: int) -> str:
    return (f"{p.config}, micro-batch {p.micro_batch} x accumulation {accumulation}, gradient checkpointing "
            f"{plan_checkpointing_words(p)}"
            + ("" if (p.optim, p.bf16_stochastic_round) == OPTIMIZER_LADDER[0] else
               f", optimizer {optimizer_words(p.optim, p.bf16_stochastic_round)}"))


def least_per_gpu(p: MemoryPlan) -> tuple[float, int]:
    """Order plans by their bytes per GPU, and on a tie (a phase that does not depend on the batch) by micro-batch."""
    return p.per_gpu["total"], p.micro_batch


def _smallest(p: MemoryPlan) -> str:
    """The plan that needs least per GPU, as a phrase."""
    return (f"{p.config} with micro-batch {p.micro_batch} and checkpointing "
            f"{plan_checkpointing_words(p)}, needs "
            f"{gb(p.per_gpu['total'])} per GPU")


def _fit_message(chosen: MemoryPlan, accumulation: int, offload: bool, shape: ModelShape, hardware: Hardware,
                 search: Search) -> str:
    text = (f"{shape.name} on {hardware.name}: {describe_plan(chosen, accumulation)}: {gb(chosen.per_gpu['total'])} "
            f"of {gb(chosen.capacity)} usable per GPU, {gb(chosen.host_ram_per_node)} of "
            f"{gb(chosen.host_ram_capacity)} usable host RAM per node.")
    if offload:
        smallest = min((p for p, _, off in candidates(shape, hardware, search) if not off), key=least_per_gpu)
        text += f" No GPU-only config fits: the smallest, {_smallest(smallest)} against {gb(smallest.capacity)} usable."
    if (chosen.optim, chosen.bf16_stochastic_round) != OPTIMIZER_LADDER[0]:
        exact = dataclasses.replace(search, optim=OPTIMIZER_LADDER[0][0], bf16_stochastic_round=False)
        kept = next(((p, a) for p, a, _ in candidates(shape, hardware, exact) if p.fits), None)
        text += (" No run with torch's AdamW over the fp32 master fits the GPUs; the fastest that fits with it: "
                 f"{describe_plan(*kept)}, {gb(kept[0].host_ram_per_node)} host RAM per node." if kept else
                 " No run with torch's AdamW over the fp32 master fits here.")
    return text


def launch_command(chosen: MemoryPlan, recipe: str) -> str:
    """The plan as the command that launches it: the accelerate config, the recipe, the fields the plan chose."""
    # Under TP the data-parallel size is the processes over tp_size (the config's is for 2 nodes).
    tensor = (f"--parallelism_config_dp_shard_size {chosen.world_size // chosen.tensor_parallel} "
              if chosen.tensor_parallel > 1 else "")
    return (f"accelerate launch --config_file accelerate_configs/{chosen.config}.yaml {tensor}{recipe} "
            f"--per_device_train_batch_size "
            f"{chosen.micro_batch} --gradient_checkpointing {str(chosen.gradient_checkpointing).lower()}"
            + (f" --gradient_checkpointing_mode {chosen.gradient_checkpointing_mode}"
               if chosen.gradient_checkpointing else "")
            + (f" --gradient_checkpointing_interval {chosen.gradient_checkpointing_interval}"
               if chosen.gradient_checkpointing and chosen.gradient_checkpointing_interval > 1 else "")
            + f" --optim {chosen.optim} --bf16_stochastic_round {str(chosen.bf16_stochastic_round).lower()}"
            + (" --mixed_precision fp8" if chosen.mixed_precision == "fp8" else "")
            + (" --method dpo" if chosen.method == "dpo" else "")
            + (" --precompute_ref_log_probs true" if chosen.reference_mode == "precomputed" else ""))


def fewest_nodes(shape: ModelShape, hardware: Hardware, search: Search,
                 gpu_only: bool = False) -> tuple[int, Recommendation] | None:
    """The smallest number of `hardware`'s nodes, from `hardware.nodes` up to MAX_NODES, on which some config
    (GPU-only ones if `gpu_only`) fits while keeping the global batch, and the fastest plan there; None when no
    count does. A search that takes more than PROGRESS_EVERY_S says how far it got on stderr."""
    said = time.monotonic()
    for nodes in range(hardware.nodes, MAX_NODES + 1):
        if nodes > hardware.nodes and time.monotonic() - said > PROGRESS_EVERY_S:
            print(f"planning {shape.name}: nothing {'GPU-only ' if gpu_only else ''}fits {nodes - 1} nodes of "
                  f"{hardware.with_nodes(1).name}; trying {nodes} (up to {MAX_NODES})...", file=sys.stderr,
                  flush=True)
            said = time.monotonic()
        bigger = hardware.with_nodes(nodes)
        if not keeps_batch(search, bigger):
            continue  # the global batch does not divide over these GPUs, nor over their nodes
        for candidate, accumulation, offload in candidates(shape, bigger, search):
            if candidate.fits and not (gpu_only and offload):
                return nodes, Recommendation(candidate, not offload, accumulation, "")
    return None


def nothing_fits(shape: ModelShape, hardware: Hardware, search: Search) -> str:
    """What binds on this hardware (the GPUs, or the host RAM of the plans the GPUs would hold), and the
    smallest number of such nodes on which some config fits, every strategy considered."""
    plans = [p for p, _, _ in candidates(shape, hardware, search)]
    within_gpu = [p for p in plans if p.gpu_fits]
    if within_gpu:
        least = min(within_gpu, key=lambda p: p.host_ram_per_node)
        binding = (f"host RAM: the plans that fit the GPUs need {gb(least.host_ram_per_node)} per node at the "
                   f"least ({least.config}), {gb(least.host_ram_capacity)} is usable (give the node's RAM with "
                   "--host_ram_gb)")
    else:
        least = min(plans, key=least_per_gpu)
        binding = f"GPU memory: the smallest plan, {_smallest(least)}, {gb(least.capacity)} is usable"
    text = f"Nothing fits {shape.name} on {hardware.name}; the binding limit is {binding}."
    found = fewest_nodes(shape, hardware.with_nodes(hardware.nodes + 1), search)
    if found is None:
        text += f" It fits on no number of such nodes up to {MAX_NODES} with this global batch."
    else:
        nodes, fitting = found
        text += (f" It fits on {nodes} such nodes ({fitting.plan.hardware}): "
                 f"{describe_plan(fitting.plan, fitting.accumulation)}, {gb(fitting.plan.per_gpu['total'])} per GPU.")
        if not fitting.gpu_only:
            fast = fewest_nodes(shape, hardware.with_nodes(nodes + 1), search, gpu_only=True)
            text += (f" Without offload it fits on {fast[0]} nodes: "
                     f"{describe_plan(fast[1].plan, fast[1].accumulation)}." if fast else
                     f" Without offload it fits on no number of nodes up to {MAX_NODES} with this global batch.")
    if search.reference == "live":
        text += " DPO's live reference is a second model: --precompute_ref_log_probs true holds none while training."
    return text + ("" if search.peft else " LoRA or QLoRA (--use_peft true) needs far less.")


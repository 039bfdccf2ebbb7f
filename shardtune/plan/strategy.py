"""What an accelerate config means for memory: the Strategy, read from an accelerate config YAML and the DeepSpeed
JSON file it names. The one reader of those files, for the planner, the start-up checks and the cross-rank
fingerprint; light (no torch, no transformers), since the runtime imports it before anything loads."""

from __future__ import annotations

import copy
import functools
import glob
import json
import os
from dataclasses import dataclass, replace

import yaml

from shardtune.config import MIXED_PRECISIONS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS_DIR = os.path.join(REPO, "accelerate_configs")

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), for a DeepSpeed config without a JSON file. The shipped
# configs set their own in accelerate_configs/deepspeed/*.json, read into the Strategy (deepspeed_settings).
DS_REDUCE_BUCKET = int(5e8)  # elements; gradients are reduced through a flat bucket of this size
DS_PREFETCH_BUCKET = int(5e7)  # elements; ZeRO-3 prefetches up to this many parameters ahead
DS_SUB_GROUP = int(1e9)  # elements of a rank's ZeRO-3 partition that the optimizer steps at once
DS_PERSISTENCE_THRESHOLD = int(1e5)  # ZeRO-3 keeps parameters of at most this many elements whole on every rank
DS_MAX_LIVE_PARAMETERS = int(1e9)  # elements of gathered ZeRO-3 parameters alive at once
DS_NVME_PARAM_BUFFERS = (5, int(1e8))  # offload_param buffer_count, buffer_size: pinned host staging for NVMe
DS_NVME_OPTIMIZER_BUFFERS = 4  # offload_optimizer buffer_count: pinned buffers of one sub-group each
DS_NVME_MAX_IN_CPU = int(1e9)  # offload_param max_in_cpu: elements of a rank's partitions kept in host RAM
# fp8 (shardtune.levers.float8) computes everything but its float8 linears in bf16: a 16-bit module like bf16's.
HALF_PRECISIONS = ("bf16", "fp16", "fp8")


class PlanError(ValueError):
    """A config file or option the planner cannot use."""


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: str  # "ddp" (also single GPU), "fsdp" or "deepspeed"
    shard: int  # ZeRO stage equivalent: 0 none, 1 optimizer, 2 + gradients, 3 + parameters
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_params: str = "none"
    ram_efficient_loading: bool = False
    mixed_precision: str = "bf16"
    # DeepSpeed's buffers and chunks in elements: the JSON's zero_optimization, DeepSpeed's defaults without one;
    # None where the JSON says "auto" (accelerate derives it from hidden_size: see states.deepspeed_sizes).
    reduce_bucket: int | None = DS_REDUCE_BUCKET
    overlap_comm: bool = False  # ZeRO-1/2 then allocate a second reduce bucket (ZeRO-3 overlaps by default)
    prefetch_bucket: int | None = DS_PREFETCH_BUCKET
    sub_group: int | None = DS_SUB_GROUP
    persistence_threshold: int | None = DS_PERSISTENCE_THRESHOLD
    max_live_parameters: int | None = DS_MAX_LIVE_PARAMETERS
    # NVMe offload's pinned host buffers (only where the device is nvme): parameter buffers (count, elements
    # each) and the optimizer swapper's buffer count.
    nvme_param_buffers: tuple[int, int] = DS_NVME_PARAM_BUFFERS
    nvme_optimizer_buffers: int = DS_NVME_OPTIMIZER_BUFFERS
    nvme_max_in_cpu: int = DS_NVME_MAX_IN_CPU
    # Multi-node layouts. shard_group: the GPUs the states are sharded over, 0 for all of them; FSDP2's hybrid
    # sharding (accelerate's parallelism_config) shards over dp_shard_size GPUs and replicates across the rest.
    # hpz_partition: ZeRO++'s zero_hpz_partition_size, a secondary copy of the 16-bit weights sharded over that
    # many GPUs (a node) that the layers are gathered from, beside the partitions over all of them.
    shard_group: int = 0
    hpz_partition: int = 1
    # The sequence split (accelerate's parallelism_config_sp_size under DeepSpeed: Ulysses): each sequence over
    # this many GPUs, 1 for none (shardtune.parallel.sequence).
    sequence_split: int = 1
    # Tensor parallelism (accelerate's parallelism_config_tp_size, shardtune.parallel.tensor): every layer's
    # matmuls split over groups of this many GPUs, FSDP2 sharding each GPU's slices over the rest (world / tp);
    # 1 for none (plan.tensor).
    tensor_parallel: int = 1
    # Context parallelism (accelerate's parallelism_config_cp_size under FSDP2: torch's ring attention): each
    # sequence over this many GPUs, the states sharded over all of them; 1 for none (shardtune.parallel.context).
    context_parallel: int = 1

    @property
    def split_positions(self) -> int:
        """The GPUs each row's positions are split over: by Ulysses or by the ring attention."""
        return self.sequence_split * self.context_parallel

    @property
    def multi_node_layout(self) -> bool:
        """Hybrid sharding or hpZ: a layout that differs from its one-node config only across nodes."""
        return self.shard_group > 0 or self.hpz_partition > 1

    def sharded_over(self, world: int) -> int:
        """The GPUs out of `world` over which this strategy shards its states."""
        return min(self.shard_group, world) if self.shard_group else world

    def layout(self, world: int) -> str:
        """How the states lie over `world` GPUs, in words: "replicated", "sharded over N GPUs", "sharded over
        N GPUs, replicated xR", or ZeRO++'s "sharded over N GPUs, a copy of the weights sharded over H"; and the
        sequence split's ", each sequence split over S GPUs"."""
        if self.kind == "ddp" or (self.kind == "deepspeed" and self.shard == 0):
            return "replicated"
        shard = self.sharded_over(world)
        text = f"sharded over {shard} GPUs" + (f", replicated x{world // shard}" if shard < world else "")
        if self.kind == "deepspeed" and self.shard >= 3 and self.hpz_partition > 1:
            text += f", a copy of the weights sharded over {min(self.hpz_partition, world)}"
        if self.sequence_split > 1:
            text += f", each sequence split over {self.sequence_split} GPUs"
        if self.context_parallel > 1:
            text += f", each sequence split over {self.context_parallel} GPUs (context parallel)"
        if self.tensor_parallel > 1:  # FSDP2 shards each GPU's slices over the data-parallel ranks
            data = shard // self.tensor_parallel
            text = (f"each layer split over {self.tensor_parallel} GPUs (tensor parallel)"
                    + ("" if self.kind == "ddp" else f", its slices sharded over {data} GPUs"))
        return text

    @property
    def half_precision(self) -> bool:
        """bf16, fp16 or fp8: DeepSpeed converts the module, FSDP2 gathers 16-bit parameters, DDP autocasts."""
        return self.mixed_precision in HALF_PRECISIONS

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the 16-bit module (DeepSpeed's weights and gradients, FSDP's gathered
        parameters, communication buffers): 2 in bf16 and fp16, 4 in fp32."""
        return 2 if self.half_precision else 4

    @property
    def float8(self) -> bool:
        """--mixed_precision fp8: the decoder layers' linears train in float8 (shardtune.levers.float8)."""
        return self.mixed_precision == "fp8"

    @property
    def takes_float8(self) -> bool:
        """Whether fp8 trains under this config (shardtune.levers.float8.check_fp8): FSDP2 without offload, or DDP; not
        under context parallelism (shardtune.parallel.context refuses it)."""
        return self.context_parallel == 1 and (self.kind == "ddp" or (self.kind == "fsdp" and not self.offloads))

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_params != "none"


@functools.lru_cache(maxsize=256)
def parsed_yaml(path: str, version: tuple[int, int, int]) -> dict:
    """The YAML at `path` as it was at `version` (inode, size, mtime: an edited file is read again). A search reads
    each config once per candidate, thousands of times; PyYAML's pure-Python parser took half a plan table's time."""
    with open(path) as file:
        return yaml.safe_load(file) or {}


def read_accelerate_config(path: str, mixed_precision: str | None = None,
                           deepspeed_config_file: str | None = None) -> Strategy:
    """Any accelerate config YAML: distributed_type, fsdp_config, deepspeed_config (and the DeepSpeed JSON file it
    names, or `deepspeed_config_file` in its place, as `accelerate launch --deepspeed_config_file` overrides it),
    mixed_precision. The GPU count comes from --hardware, not from num_processes."""
    try:
        stat = os.stat(path)
        config = copy.deepcopy(parsed_yaml(path, (stat.st_ino, stat.st_size, stat.st_mtime_ns)))
    except (OSError, yaml.YAMLError) as error:
        raise PlanError(f"Cannot read accelerate config {path!r}: {' '.join(str(error).split())}") from error
    check_accelerate_config(path, config)
    name = os.path.splitext(os.path.basename(path))[0]
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        json_file = deepspeed_config_file or ds.get("deepspeed_config_file")
        if json_file:
            settings = deepspeed_settings(resolve_deepspeed_json(str(json_file), path))
        else:
            settings = deepspeed_yaml_settings(ds)
        # A JSON's bf16/fp16 "auto" takes the run's precision: the recipe's, bf16 unless it says otherwise.
        precision = settings.pop("mixed_precision") or mixed_precision or config.get("mixed_precision") or "bf16"
        strategy = deepspeed_strategy(name, settings, bool(ds.get("zero3_init_flag", False)),
                                      _precision(path, precision))
        return replace(strategy, sequence_split=sequence_split_size(path, config.get("parallelism_config") or {}),
                       tensor_parallel=tensor_parallel_size(path, config.get("parallelism_config") or {}))
    precision = _precision(path, mixed_precision or config.get("mixed_precision") or "no")
    if kind == "FSDP":
        fsdp = config.get("fsdp_config") or {}
        reshard = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", True))
        if isinstance(reshard, str):  # FSDP1 names, also accepted by accelerate for FSDP2
            reshard = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}.get(reshard.upper(), True)
        offload = "cpu" if fsdp.get("fsdp_offload_params") else "none"
        strategy = fsdp_strategy(name, bool(reshard), offload,
                                 bool(fsdp.get("fsdp_cpu_ram_efficient_loading", False)), precision,
                                 hybrid_shard_size(path, config.get("parallelism_config") or {}))
        parallelism = config.get("parallelism_config") or {}
        return replace(strategy, tensor_parallel=tensor_parallel_size(path, parallelism),
                       context_parallel=parallel_size(path, parallelism, "cp"))
    if kind in ("MULTI_GPU", "NO", "MULTI_CPU"):
        return Strategy(name, "ddp", 0, mixed_precision=precision,
                        tensor_parallel=tensor_parallel_size(path, config.get("parallelism_config") or {}))
    raise PlanError(f"{path}: distributed_type {kind!r} is not planned (use NO, MULTI_GPU, FSDP or DEEPSPEED).")


# Keys of a DeepSpeed config JSON that no accelerate config holds at its top level.
DEEPSPEED_JSON_KEYS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "bf16", "fp16",
                       "gradient_clipping", "optimizer", "scheduler")


def check_accelerate_config(path: str, config: object) -> None:
    """An accelerate config names its distributed_type, as `accelerate launch` requires: a DeepSpeed JSON (which
    the accelerate YAML points at with deepspeed_config_file) or any other file is refused, not planned as DDP."""
    if isinstance(config, dict) and "distributed_type" in config:
        return
    if isinstance(config, dict) and any(key in config for key in DEEPSPEED_JSON_KEYS):
        users = yamls_naming(path)
        use = (f"give the accelerate config that uses it: {' or '.join(users)}" if users else
               "give an accelerate config YAML that names it (distributed_type: DEEPSPEED, deepspeed_config: "
               f"deepspeed_config_file: {path}), e.g. a copy of accelerate_configs/ds_zero3.yaml")
        raise PlanError(f"--config_file {path!r} is a DeepSpeed config JSON, not an accelerate config: {use}.")
    raise PlanError(f"--config_file {path!r} is not an accelerate config (it names no distributed_type, which "
                    "accelerate launch requires): give one such as accelerate_configs/fsdp_full_shard.yaml.")


def yamls_naming(json_path: str) -> list[str]:
    """The shipped accelerate configs whose deepspeed_config_file is `json_path`, relative to the working directory
    where they lie below it."""
    target, users = os.path.realpath(json_path), []
    for yaml_path in sorted(glob.glob(os.path.join(CONFIGS_DIR, "*.yaml"))):
        try:
            with open(yaml_path) as file:
                named = ((yaml.safe_load(file) or {}).get("deepspeed_config") or {}).get("deepspeed_config_file")
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if named and os.path.realpath(resolve_deepspeed_json(str(named), yaml_path)) == target:
            relative = os.path.relpath(yaml_path)
            users.append(yaml_path if relative.startswith("..") else relative)
    return users


def hybrid_shard_size(path: str, parallelism: dict) -> int:
    """The GPUs FSDP2 shards over where a YAML's parallelism_config (as `accelerate config` writes it) replicates
    (dp_replicate_size > 1): hybrid sharding over dp_shard_size x cp_size (accelerate's dp_shard_cp mesh); 0
    otherwise (sharded over every GPU)."""
    try:
        replicate = int(parallelism.get("parallelism_config_dp_replicate_size", 1))
        shard = int(parallelism.get("parallelism_config_dp_shard_size", 1))
        context = int(parallelism.get("parallelism_config_cp_size", 1))
    except (TypeError, ValueError) as error:
        raise PlanError(f"{path}: parallelism_config sizes must be whole numbers ({error}).") from error
    return shard * context if replicate > 1 else 0


def sequence_split_size(path: str, parallelism: dict) -> int:
    """The sp_size of a DeepSpeed YAML's parallelism_config: the sequence split (Ulysses), 1 without one."""
    try:
        return int(parallelism.get("parallelism_config_sp_size", 1))
    except (TypeError, ValueError) as error:
        raise PlanError(f"{path}: parallelism_config_sp_size must be a whole number ({error}).") from error


def tensor_parallel_size(path: str, parallelism: dict) -> int:
    """The tp_size of a YAML's parallelism_config: each layer split over that many GPUs, 1 without TP."""
    return parallel_size(path, parallelism, "tp")


def parallel_size(path: str, parallelism: dict, axis: str) -> int:
    """The `axis` size (tp, cp) of a YAML's parallelism_config, 1 where it sets none."""
    try:
        return int(parallelism.get(f"parallelism_config_{axis}_size", 1))
    except (TypeError, ValueError) as error:
        raise PlanError(f"{path}: parallelism_config_{axis}_size must be a whole number ({error}).") from error


def tensor_parallel_launch_args(config_file: str, world: int) -> list[str]:
    """A tensor- or context-parallel config's data-parallel size on `world` processes, as its launch line gives it
    (--parallelism_config_dp_shard_size <processes / group>: fsdp_tp.yaml's tp groups or fsdp_cp.yaml's cp groups
    within a node, dp_shard over the nodes, as scripts/slurm/train.sbatch launches them); [] for any other config,
    or where the group does not divide the processes (the launch checks refuse that)."""
    try:
        with open(config_file) as file:
            parallelism = (yaml.safe_load(file) or {}).get("parallelism_config") or {}
        group = int(parallelism.get("parallelism_config_tp_size", 1)) * \
            int(parallelism.get("parallelism_config_cp_size", 1))
        replicate = int(parallelism.get("parallelism_config_dp_replicate_size", 1))
    except (OSError, yaml.YAMLError, TypeError, ValueError, AttributeError):
        return []  # accelerate's launcher reports what is wrong with the file
    if group <= 1 or replicate != 1 or world % group:
        return []
    return ["--parallelism_config_dp_shard_size", str(world // group)]


def _precision(path: str, precision: str) -> str:
    if precision not in MIXED_PRECISIONS:
        raise PlanError(f"{path}: mixed_precision {precision!r} is not one of {', '.join(MIXED_PRECISIONS)}.")
    return precision


def resolve_deepspeed_json(path: str, accelerate_config: str | None = None) -> str:
    """A YAML's deepspeed_config_file as accelerate opens it (relative to the working directory), else relative to
    the repository or to the YAML's folder's parent: the shipped YAMLs name accelerate_configs/deepspeed/*.json,
    which resolves from the repository root and from anywhere else as well."""
    if os.path.isabs(path):
        return path
    bases = [os.getcwd(), REPO] + ([os.path.dirname(os.path.dirname(os.path.abspath(accelerate_config)))]
                                   if accelerate_config else [])
    for base in bases:
        candidate = os.path.join(base, path)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return path


def _size(zero: dict, key: str, default: int) -> int | None:
    """An element count of zero_optimization; None where it is "auto" (accelerate derives it from hidden_size)."""
    value = zero.get(key, default)
    if value == "auto":
        return None
    try:
        return int(float(value))
    except (TypeError, ValueError) as error:
        raise PlanError(f"zero_optimization.{key} {value!r} is not a number of elements or \"auto\".") from error


def deepspeed_settings(path: str) -> dict:
    """What a DeepSpeed JSON file sets for memory, with DeepSpeed's defaults for what it leaves out: the one source
    of the stage, offload devices, precision and buffer sizes for the start-up checks, the cross-rank fingerprint
    and the planner. mixed_precision is None where bf16/fp16 are "auto" (accelerate fills them from the run)."""
    try:
        with open(path) as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise PlanError(f"Cannot read the DeepSpeed config file {path!r}: {error}") from error
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        raise PlanError(f"The DeepSpeed config file {path!r} has no zero_optimization section.")
    stage = zero.get("stage", 0)
    precision = None
    enabled = {dtype: str((config.get(dtype) or {}).get("enabled", "auto")).lower() for dtype in ("bf16", "fp16")}
    if "true" in enabled.values():
        precision = "bf16" if enabled["bf16"] == "true" else "fp16"
    elif set(enabled.values()) == {"false"}:
        precision = "no"
    offload_optimizer, offload_param = (zero.get("offload_optimizer") or {}), (zero.get("offload_param") or {})
    return {
        "stage": stage,
        "offload_optimizer": str(offload_optimizer.get("device", "none")).lower(),
        "offload_param": str(offload_param.get("device", "none")).lower(),
        "nvme_path": {kind: (zero.get(f"offload_{kind}") or {}).get("nvme_path") for kind in ("optimizer", "param")},
        "mixed_precision": precision,
        "reduce_bucket": _size(zero, "reduce_bucket_size", DS_REDUCE_BUCKET),
        "overlap_comm": bool(zero.get("overlap_comm", str(stage) == "3")),
        "prefetch_bucket": _size(zero, "stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET),
        "sub_group": _size(zero, "sub_group_size", DS_SUB_GROUP),
        "persistence_threshold": _size(zero, "stage3_param_persistence_threshold", DS_PERSISTENCE_THRESHOLD),
        "max_live_parameters": _size(zero, "stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS),
        "nvme_param_buffers": (int(offload_param.get("buffer_count", DS_NVME_PARAM_BUFFERS[0])),
                               int(float(offload_param.get("buffer_size", DS_NVME_PARAM_BUFFERS[1])))),
        "nvme_optimizer_buffers": int(offload_optimizer.get("buffer_count", DS_NVME_OPTIMIZER_BUFFERS)),
        "nvme_max_in_cpu": int(float(offload_param.get("max_in_cpu", DS_NVME_MAX_IN_CPU))),
        "hpz_partition": int(zero.get("zero_hpz_partition_size", 1)),
        # ZeRO-3 reduce-scatters every gradient bucket (DeepSpeed's default), which averages over all ranks: the
        # sequence split's gradient scale depends on it (shardtune.parallel.sequence).
        "reduce_scatter": bool(zero.get("reduce_scatter", True)),
    }


def deepspeed_yaml_settings(ds: dict) -> dict:
    """A YAML's deepspeed_config without a JSON file (or the ACCELERATE_DEEPSPEED_* variables `accelerate launch`
    exports from it): accelerate builds the config from these keys alone, so every buffer size is DeepSpeed's
    default."""
    stage = ds.get("zero_stage", 2)  # accelerate's default stage
    return {"stage": stage, "offload_optimizer": str(ds.get("offload_optimizer_device") or "none").lower(),
            "offload_param": str(ds.get("offload_param_device") or "none").lower(), "mixed_precision": None,
            "overlap_comm": str(stage) == "3"}


def deepspeed_strategy(name: str, settings: dict, zero3_init: bool, precision: str) -> Strategy:
    """The Strategy of deepspeed_settings (or deepspeed_yaml_settings) without their mixed_precision, which the
    caller resolves against the run's."""
    try:
        stage = int(settings["stage"])
    except (TypeError, ValueError) as error:
        raise PlanError(f"{name}: ZeRO stage {settings['stage']!r} is not 1, 2 or 3.") from error
    sizes = {key: settings[key] for key in ("reduce_bucket", "overlap_comm", "prefetch_bucket", "sub_group",
                                            "persistence_threshold", "max_live_parameters", "nvme_param_buffers",
                                            "nvme_optimizer_buffers", "nvme_max_in_cpu", "hpz_partition")
             if key in settings}
    return Strategy(name, "deepspeed", stage, settings["offload_optimizer"], settings["offload_param"],
                    zero3_init and stage == 3, precision, **sizes)


def fsdp_strategy(name: str, reshard_after_forward: bool, offload: str, ram_efficient_loading: bool,
                  precision: str, shard_group: int = 0) -> Strategy:
    """FSDP2: FULL_SHARD (reshard after forward) shards like ZeRO-3, SHARD_GRAD_OP like ZeRO-2; CPU offload moves
    weights, gradients and optimizer states together. `shard_group`: hybrid sharding's dp_shard_size (0: all)."""
    return Strategy(name, "fsdp", 3 if reshard_after_forward else 2, offload, offload, ram_efficient_loading,
                    precision, shard_group=shard_group)

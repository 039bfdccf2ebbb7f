"""The launch as `accelerate launch` describes it to each process: its environment variables and the DeepSpeed
JSON file it names, read once into a LaunchDescription and checked before any process group exists. The start-up
checks, the Accelerator, the launch-time memory plan and the cross-rank fingerprint all read it from here. The
accelerate config file's own keys are checked in shardtune.checks.launch_config; the launch a --dry_run plans is
built in shardtune.parallel.planned_launch."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from shardtune.config import OFFLOAD_DEVICES, ZERO_STAGES, ConfigError
from shardtune.parallel.context import checked_context_parallel
from shardtune.parallel.launcher_args import LauncherRequest, launcher_problems
from shardtune.parallel.tensor import checked_tensor_parallel
from shardtune.plan.strategy import (
    PlanError,
    Strategy,
    deepspeed_settings,
    deepspeed_strategy,
    deepspeed_yaml_settings,
    fsdp_strategy,
    resolve_deepspeed_json,
)

ON = "true"  # how `accelerate launch` exports a boolean


@dataclass(frozen=True)
class LaunchDescription:
    """One process's launch. DeepSpeed's settings are deepspeed_settings of the JSON file (deepspeed_config_file,
    resolved as accelerate_configs' YAMLs name it), else of the variables accelerate exports for a YAML-only
    deepspeed_config; FSDP's are the FSDP_* variables it exports from the fsdp_config."""

    world_size: int = 1
    local_world_size: int = 1
    uses_deepspeed: bool = False
    uses_fsdp: bool = False
    deepspeed_config_file: str | None = None
    deepspeed_settings: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    zero3_init: bool = False
    fsdp_reshard_after_forward: bool = True
    fsdp_offload_params: bool = False
    fsdp_cpu_ram_efficient_loading: bool = False
    # accelerate's ParallelismConfig (hybrid sharding): the states sharded over dp_shard_size ranks and replicated
    # dp_replicate_size times; 0 where the launch has none (sharded over every rank).
    dp_shard_size: int = 0
    dp_replicate_size: int = 0
    # accelerate's ParallelismConfig sp_size under DeepSpeed: every sequence split over this many ranks (Ulysses,
    # shardtune.parallel.sequence); 1 without the split.
    sp_size: int = 1
    # accelerate's ParallelismConfig tp_size: every layer split over groups of this many ranks (FSDP2 shards over
    # dp_shard_size beside it; shardtune.parallel.tensor); 1 without TP.
    tp_size: int = 1
    # accelerate's ParallelismConfig cp_size under FSDP2: every sequence cut over this many ranks by torch's ring
    # attention (shardtune.parallel.context); 1 without CP.
    cp_size: int = 1
    # The mixed precision `accelerate launch` exported, and where it came from: "flag" (its --mixed_precision),
    # "config" (the config file's), "" (its default, or no launcher read); the recipe's own precision is applied.
    launcher_precision: str = ""
    launcher_precision_source: str = ""

    @classmethod
    def from_env(cls, launcher: LauncherRequest | None = None) -> LaunchDescription:
        """This process's launch, from os.environ, and from `launcher`, the `accelerate launch` command line that
        started it (parallel.launcher_args.this_launcher): a setting it was given and did not pass on is refused.
        Raises ConfigError for a launch environment in which the ranks could not meet or the trainer could not
        run."""
        world_size = env_int("WORLD_SIZE", 1)
        rank = env_int("RANK", 0)
        check_ranks(world_size, rank)
        uses_deepspeed = env_flag("ACCELERATE_USE_DEEPSPEED", "false")
        uses_fsdp = env_flag("ACCELERATE_USE_FSDP", "false")
        settings = checked_deepspeed_settings() if uses_deepspeed else {}
        check_hpz(settings.get("hpz_partition", 1), world_size)
        if uses_fsdp:
            check_fsdp_env()
        dp_shard, dp_replicate, sp, tp, cp = checked_parallelism(world_size, uses_fsdp, uses_deepspeed)
        config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if uses_deepspeed else None
        launch = cls(
            world_size=world_size, local_world_size=env_int("LOCAL_WORLD_SIZE", 1), uses_deepspeed=uses_deepspeed,
            uses_fsdp=uses_fsdp,
            deepspeed_config_file=resolve_deepspeed_json(config_file) if config_file else None,
            deepspeed_settings=MappingProxyType(settings),
            zero3_init=env_flag("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false"),
            fsdp_reshard_after_forward=env_flag("FSDP_RESHARD_AFTER_FORWARD", ON),
            fsdp_offload_params=env_flag("FSDP_OFFLOAD_PARAMS", "false"),
            fsdp_cpu_ram_efficient_loading=env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING", "false"),
            dp_shard_size=dp_shard, dp_replicate_size=dp_replicate, sp_size=sp, tp_size=tp, cp_size=cp,
            launcher_precision=launcher.mixed_precision if launcher else "",
            launcher_precision_source=launcher.precision_source if launcher else "",
        )
        problems = launcher_problems(launcher, world_size, launch.description) if launcher else []
        if problems:
            raise ConfigError(problems)
        return launch

    @property
    def parallelism_sizes(self) -> dict[str, int]:
        """The parallelism sizes this run applies, as run_config.json records them (0: sharded over every rank)."""
        return {"tp_size": self.tp_size, "cp_size": self.cp_size, "sp_size": self.sp_size,
                "dp_shard_size": self.dp_shard_size, "dp_replicate_size": self.dp_replicate_size}

    @property
    def hybrid_shard(self) -> bool:
        """FSDP2 over a (replicate, shard) mesh: accelerate's ParallelismConfig with dp_replicate_size > 1."""
        return self.dp_replicate_size > 1

    @property
    def data_parallel_size(self) -> int:
        """The ranks that each run their own rows: the ranks of a tensor- or context-parallel group run the same."""
        return self.world_size // (self.tp_size * self.cp_size)

    @property
    def description(self) -> str:
        """The strategy in words, as the start-up line says it: "DeepSpeed ZeRO-3, optimizer offloaded to cpu",
        "FSDP2 FULL_SHARD", "DDP", or "one process"; ", tensor parallel over N ranks" under TP."""
        tensor = f"tensor parallel over {self.tp_size} ranks" if self.tp_size > 1 else ""
        if self.uses_deepspeed:
            offloaded = [f"{states} offloaded to {device}" for kind, states in (("optimizer", "optimizer"),
                                                                               ("param", "parameters"))
                         if (device := self.deepspeed_settings.get(f"offload_{kind}", "none")) != "none"]
            split = [f"sequences split over {self.sp_size} ranks (Ulysses)"] if self.sp_size > 1 else []
            return ", ".join([f"DeepSpeed ZeRO-{self.deepspeed_settings.get('stage')}", *offloaded, *split])
        if self.uses_fsdp:  # FSDP2's reshard-after-forward is FSDP1's FULL_SHARD; without it, SHARD_GRAD_OP
            sharding = "FULL_SHARD" if self.fsdp_reshard_after_forward else "SHARD_GRAD_OP"
            if self.hybrid_shard:
                sharding += f" over {self.dp_shard_size} ranks, replicated x{self.dp_replicate_size}"
            offload = ", parameters offloaded to cpu" if self.fsdp_offload_params else ""
            context = f", sequences split over {self.cp_size} ranks (context parallel)" if self.cp_size > 1 else ""
            return f"FSDP2 {sharding}{offload}{context}" + (f", {tensor}" if tensor else "")
        return tensor or ("DDP" if self.world_size > 1 else "one process")

    @property
    def deepspeed_offloads(self) -> bool:
        """DeepSpeed offloads the optimizer or the parameters: it pins large host buffers."""
        return self.uses_deepspeed and any(self.deepspeed_settings.get(f"offload_{kind}", "none") != "none"
                                           for kind in ("optimizer", "param"))

    @property
    def kind(self) -> str:
        """"deepspeed", "fsdp" or "ddp" (also one process)."""
        return "deepspeed" if self.uses_deepspeed else "fsdp" if self.uses_fsdp else "ddp"

    @property
    def num_machines(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def nvme_offloaded(self) -> tuple[str, ...]:
        """The states ("optimizer", "param") DeepSpeed offloads to NVMe into the directory --offload_nvme_path
        gives: a JSON file may name its own; "auto" (the shipped one's) or none takes the flag's."""
        if not self.uses_deepspeed:
            return ()
        settings = self.deepspeed_settings
        return tuple(kind for kind in ("optimizer", "param") if settings[f"offload_{kind}"] == "nvme"
                     and settings.get("nvme_path", {}).get(kind) in (None, "auto", "none"))

    def strategy(self, mixed_precision: str) -> Strategy:
        """The planner's Strategy of this launch under the run's precision (a DeepSpeed JSON's own bf16/fp16
        setting wins where it sets one)."""
        if self.kind == "deepspeed":
            settings = dict(self.deepspeed_settings)
            precision = settings.pop("mixed_precision") or mixed_precision
            strategy = deepspeed_strategy(f"DeepSpeed ZeRO-{settings['stage']}", settings, self.zero3_init, precision)
            return dataclasses.replace(strategy, sequence_split=self.sp_size)
        if self.kind == "fsdp":
            reshard = self.fsdp_reshard_after_forward
            offload = "cpu" if self.fsdp_offload_params else "none"
            strategy = fsdp_strategy(f"FSDP {'FULL_SHARD' if reshard else 'SHARD_GRAD_OP'}", reshard, offload,
                                     self.fsdp_cpu_ram_efficient_loading, mixed_precision,
                                     self.dp_shard_size * self.cp_size if self.hybrid_shard else 0)
            return dataclasses.replace(strategy, tensor_parallel=self.tp_size, context_parallel=self.cp_size)
        return Strategy("DDP", "ddp", 0, mixed_precision=mixed_precision, tensor_parallel=self.tp_size)


def env_int(name: str, default: int) -> int:
    """An integer launch variable; unset or empty gives `default`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number; unset it and start the run with accelerate "
                          "launch, which sets it.") from None


def env_flag(name: str, default: str) -> bool:
    """A boolean `accelerate launch` exports as true or false."""
    return os.environ.get(name, default).lower() == ON


def check_ranks(world_size: int, rank: int) -> None:
    """The ranks can meet: a world of at least one, this rank in it, and a rendezvous address beyond one."""
    if world_size < 1:
        raise ConfigError(f"WORLD_SIZE is {world_size}; unset it and start the run with accelerate launch, "
                          "which sets it to the number of processes.")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"RANK {rank} does not fit WORLD_SIZE {world_size} (ranks run from 0 to {world_size - 1}): relaunch "
            "with accelerate launch, giving every node the same --num_machines and --num_processes and its own "
            "--machine_rank."
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if world_size > 1 and not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE is {world_size} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            "set, so the ranks cannot find each other: launch every node with accelerate launch --num_machines N "
            "--machine_rank R --main_process_ip <rank-0 node address> --main_process_port <free port>."
        )


def launch_deepspeed_settings() -> dict:
    """deepspeed_settings of this launch: the JSON file `accelerate launch` names in ACCELERATE_DEEPSPEED_CONFIG_FILE
    (resolved as accelerate_configs' YAMLs name it), else the ACCELERATE_DEEPSPEED_* variables it exports for a
    YAML-only deepspeed_config. A JSON file that cannot be used raises ConfigError."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path:
        try:
            return deepspeed_settings(resolve_deepspeed_json(path))
        except PlanError as error:
            raise ConfigError(f"{error} Fix deepspeed_config_file in the accelerate config.") from error
    env = os.environ.get
    return deepspeed_yaml_settings({
        "zero_stage": env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"),
        "offload_optimizer_device": env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
        "offload_param_device": env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")})


def checked_deepspeed_settings() -> dict:
    """The DeepSpeed settings of the launch, read where DeepSpeed reads them: the JSON file the accelerate config
    names (deepspeed_config_file; accelerate then exports no stage or offload variables), else the variables
    `accelerate launch` exported from the YAML's deepspeed_config; refused where shardtune cannot train them."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("The accelerate config uses DeepSpeed, which is not installed: pip install deepspeed, "
                          "or launch with an FSDP or DDP config.")
    settings = launch_deepspeed_settings()
    source = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the accelerate config's deepspeed_config"
    stage = str(settings["stage"]).strip()
    if stage not in ZERO_STAGES:
        raise ConfigError(f"{source} sets zero_stage {stage!r}; shardtune trains with ZeRO stage 1, 2 or 3: set one "
                          "of these (zero_optimization.stage in a JSON file), or use ddp.yaml for no sharding.")
    for kind in ("optimizer", "param"):
        device = settings[f"offload_{kind}"]
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(f"{source} sets the offload_{kind} device {device!r}; set it to one of "
                              f"{', '.join(OFFLOAD_DEVICES)}.")
        # Below ZeRO-3, DeepSpeed ignores parameter offload and keeps an NVMe optimizer offload in CPU RAM.
        if stage != "3" and (kind == "param" or device == "nvme") and device != "none":
            raise ConfigError(f"offload_{kind}_device {device} needs ZeRO stage 3 and {source} sets zero_stage "
                              f"{stage}: set ZeRO stage 3 or offload_{kind} device none.")
    return settings


def check_fsdp_env() -> None:
    """The FSDP settings `accelerate launch` exported from the config's fsdp_config: the trainer runs FSDP2."""
    version = os.environ.get("FSDP_VERSION", "1").strip()  # accelerate's own default is FSDP1
    if version != "2":
        raise ConfigError(f"The accelerate config runs FSDP version {version} and shardtune's trainer is written "
                          "for FSDP2: set fsdp_version: 2 in its fsdp_config.")
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower()
    if reshard not in ("true", "false"):
        raise ConfigError(f"fsdp_reshard_after_forward {reshard.upper()!r} is an FSDP1 strategy; FSDP2 takes true "
                          "(like FULL_SHARD) or false (like SHARD_GRAD_OP): set one of these in the fsdp_config.")
    strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().upper()
    if strategy not in ("FULL_SHARD", "1"):  # `accelerate launch` exports FULL_SHARD unless the config says more
        raise ConfigError(f"fsdp_sharding_strategy {strategy} is an FSDP1 setting that FSDP2 ignores (the run would "
                          "fully shard): remove it, and set fsdp_reshard_after_forward: false for SHARD_GRAD_OP.")


def checked_parallelism(world_size: int, uses_fsdp: bool, uses_deepspeed: bool = False
                        ) -> tuple[int, int, int, int, int]:
    """(dp_shard_size, dp_replicate_size, sp_size, tp_size, cp_size) of the accelerate config's
    parallelism_config, as `accelerate launch` exports them, or (0, 0, 1, 1, 1) without one: data-parallel sizes
    under FSDP2 (hybrid sharding), the sequence split under DeepSpeed (Ulysses) or FSDP2 (context parallelism), or
    tensor parallelism (under FSDP2, or alone). The sizes must cover the ranks (accelerate checks that only after
    the process group is up)."""
    if not env_flag("ACCELERATE_USE_PARALLELISM_CONFIG", "false"):
        return 0, 0, 1, 1, 1
    sizes = {name: env_int(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", 1)
             for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    if sizes["cp"] != 1:
        cp = checked_context_parallel(sizes, world_size, uses_fsdp, uses_deepspeed)
        return sizes["dp_shard"], sizes["dp_replicate"], 1, 1, cp
    if sizes["sp"] != 1 and sizes["tp"] != 1:
        raise ConfigError(f"The accelerate config's parallelism_config sets sp_size {sizes['sp']} and tp_size "
                          f"{sizes['tp']}: the sequence split runs through DeepSpeed's Ulysses and tensor parallelism "
                          "under FSDP2, so the two do not compose: keep one of them.")
    if sizes["sp"] != 1:
        return 0, 0, checked_sequence_split(sizes, world_size, uses_deepspeed), 1, 1
    if sizes["tp"] != 1:
        tp = checked_tensor_parallel(sizes, world_size, uses_fsdp, uses_deepspeed)
        return sizes["dp_shard"] if uses_fsdp else 0, sizes["dp_replicate"] if uses_fsdp else 0, 1, tp, 1
    if not uses_fsdp:
        raise ConfigError("The accelerate config's parallelism_config sets data-parallel sizes and shardtune shards "
                          "by them under FSDP2 only: keep parallelism_config_dp_replicate_size and "
                          "parallelism_config_dp_shard_size (with distributed_type FSDP), or "
                          "parallelism_config_sp_size (with DeepSpeed), or parallelism_config_tp_size, or remove "
                          "the section.")
    if sizes["dp_replicate"] * sizes["dp_shard"] != world_size:
        raise ConfigError(f"parallelism_config_dp_replicate_size {sizes['dp_replicate']} x "
                          f"parallelism_config_dp_shard_size {sizes['dp_shard']} is not the {world_size} processes "
                          "launched: give accelerate launch --parallelism_config_dp_replicate_size <nodes> "
                          "--parallelism_config_dp_shard_size <processes per node>.")
    return sizes["dp_shard"], sizes["dp_replicate"], 1, 1, 1


def checked_sequence_split(sizes: dict[str, int], world_size: int, uses_deepspeed: bool) -> int:
    """The sequence split's sp_size: DeepSpeed's Ulysses (accelerate's sp_backend deepspeed, its only one), groups
    of sp consecutive ranks that divide the world; the data-parallel sizes are DeepSpeed's own (world / sp)."""
    sp = sizes["sp"]
    backend = os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed").strip()
    if not uses_deepspeed or backend != "deepspeed":
        raise ConfigError(f"The accelerate config's parallelism_config sets sp_size {sp}: the sequence split runs "
                          "through DeepSpeed's Ulysses: launch a DeepSpeed config with parallelism_config_sp_backend "
                          "deepspeed (accelerate_configs/ds_zero3_ulysses.yaml).")
    if sp < 1 or world_size % sp:
        raise ConfigError(f"parallelism_config_sp_size {sp} does not divide the {world_size} processes launched "
                          "into groups: give accelerate launch --parallelism_config_sp_size <a divisor of the "
                          "processes> (the GPUs of a node, or fewer).")
    data_sizes = [f"{name}_size {sizes[name]}" for name in ("dp_replicate", "dp_shard", "tp") if sizes[name] != 1]
    if data_sizes:
        raise ConfigError(f"The accelerate config's parallelism_config sets {', '.join(data_sizes)} beside sp_size "
                          f"{sp}: under DeepSpeed the sequence split's data-parallel size is the processes / sp_size, "
                          "set by DeepSpeed: remove them.")
    return sp


def check_hpz(hpz_partition: int, world_size: int) -> None:
    """ZeRO++'s hpZ groups consecutive ranks, min(zero_hpz_partition_size, world) of them, and needs the world to
    divide into such groups (groups.py `_create_zero_param_parallel_group`, which asserts deep inside
    deepspeed.initialize otherwise)."""
    group = min(hpz_partition, world_size)
    if group > 1 and world_size % group:
        raise ConfigError(f"zero_hpz_partition_size {hpz_partition} does not divide the {world_size} processes "
                          "launched into groups: set it to the GPUs per node in the DeepSpeed JSON file.")

"""What a checkpoint was trained with, and the check that a resume trains the same run.

Each checkpoint's marker records the run's settings (`run_settings`). A resumed run loads the optimizer's and the
schedule's state from the checkpoint, which silently replaces what the command line asks for (torch's
`Optimizer.load_state_dict` restores every hyper-parameter; the schedule's `base_lrs` too, and its length comes from
the new --max_steps), and it continues the data order of the checkpoint's seed, data and global batch. So a resume
whose settings differ from the checkpoint's is refused, one line per difference naming both values and how to
proceed, unless the difference is carried over exactly (a micro-batch and accumulation that make the same global
batch, on the same or, under DDP and FSDP2, another number of processes; a longer or shorter run on the constant
schedule), which the start-up line then says.

Standard library only: the command line checks a resume before anything heavy is imported."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, fields

from shardtune.checkpoint.markers import read_marker, resolve_resume
from shardtune.config import BatchSizes, ConfigError, Recipe
from shardtune.launch import LaunchDescription

# The recipe fields a resumed run must share with its checkpoint, by what holds them there. Any other field takes
# effect as given (logging, saving, eval, speed levers that compute the same numbers).
HELD_BY = {
    "its weights depend on it": (
        "model_name_or_path", "mixed_precision", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
        "lora_target_modules", "load_in_4bit"),
    "its optimizer state holds it": (
        "optim", "bf16_stochastic_round", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"),
    "its learning-rate schedule follows it": (
        "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio", "warmup_steps", "num_train_epochs"),
    "its loss follows it": (
        "method", "beta", "loss_type", "loss_weights", "label_smoothing", "ref_model_name_or_path"),
    "the order of the rows it continues follows it": (
        "dataset", "dataset_weights", "dataset_split", "eval_split", "eval_fraction", "dataset_format",
        "chat_template", "completion_only_loss", "truncation", "packing", "packing_strategy", "max_seq_length", "seed"),
}
HELD_FIELDS = {name for names in HELD_BY.values() for name in names}
assert HELD_FIELDS <= {f.name for f in fields(Recipe)}, HELD_FIELDS - {f.name for f in fields(Recipe)}


def run_settings(recipe: Recipe, launch: LaunchDescription, batching: BatchSizes) -> dict:
    """The settings a checkpoint of this run records in its marker (`max_steps`, resolved from the data's length,
    is added by the trainer)."""
    settings = resolved_paths({name: getattr(recipe, name) for name in sorted(HELD_FIELDS)})
    return {**settings, "explicit_max_steps": recipe.max_steps, "global_batch": batching.global_batch,
            "micro_batch": batching.micro_batch, "accumulation": batching.accumulation, "strategy": launch.kind,
            "zero_stage": launch.deepspeed_settings.get("stage") if launch.uses_deepspeed else None,
            "tp_size": launch.tp_size, "cp_size": launch.cp_size, "world_size": launch.world_size}


# The held settings that may name local files (eval_split: a file, or a split's name).
PATH_FIELDS = ("model_name_or_path", "dataset", "chat_template", "eval_split", "ref_model_name_or_path")


def resolved_paths(settings: dict) -> dict:
    """The same files, from wherever the run is launched: each local path among PATH_FIELDS (each --dataset source)
    absolute with symlinks followed, so that a relative path or a link to the same file is the same; Hub names,
    bundled templates and split names as given."""
    resolved = {key: ",".join(os.path.realpath(part.strip()) if part.strip() and os.path.exists(part.strip())
                              else part for part in settings[key].split(","))
                for key in PATH_FIELDS if isinstance(settings.get(key), str)}
    return {**settings, **resolved}


def flag(name: str, value: object) -> str:
    if isinstance(value, list):  # --loss_type sigmoid sft
        return f"--{name} {' '.join(shlex.quote(str(item)) for item in value)}"
    return f"--{name} {shlex.quote(str(value).lower() if isinstance(value, bool) else str(value))}"


def shown(value: object) -> str:
    """A recorded value as the command line writes it: `true`, not Python's `True`."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def check_resume_settings(checkpoint: str, step: int, saved: dict, current: dict) -> list[str]:
    """Raise one ConfigError listing every setting in which `current` (run_settings of this launch) differs from
    `saved` (a checkpoint's) in a way the resume cannot carry over; return the lines that say what is carried
    over. Markers written before settings were recorded (`saved` empty) are trusted as they are."""
    if not saved:
        return []
    fresh = f"or start a new run from its weights (scripts/export_hf.py {checkpoint})"
    problems, notes = [], []
    if saved["strategy"] != current["strategy"] or saved["zero_stage"] != current["zero_stage"]:
        def name(settings: dict) -> str:
            return {"deepspeed": f"DeepSpeed ZeRO-{settings['zero_stage']}", "fsdp": "FSDP2"}.get(
                settings["strategy"], "DDP or one process")
        problems.append(f"{checkpoint} was saved under {name(saved)} and this launch is {name(current)}: each "
                        f"writes its states in its own layout. Resume under the accelerate config it was saved "
                        f"with, {fresh}.")
    elif saved.get("tp_size", 1) != current.get("tp_size", 1):  # markers before TP: 1
        tp_change = tensor_parallel_change(checkpoint, saved, current, fresh)
        (notes if saved["strategy"] == "fsdp" else problems).append(tp_change)
    if saved.get("cp_size", 1) != current.get("cp_size", 1):  # CP runs under FSDP2 only: its states reshard
        notes.append(f"each sequence split over {current.get('cp_size', 1)} rank(s) (context parallel) where the "
                     f"checkpoint had {saved.get('cp_size', 1)}: torch.distributed.checkpoint reshards its FSDP2 "
                     "states")
    compared = resolved_paths(saved)  # an older marker holds paths as they were given, or absolute
    for held_by, names in HELD_BY.items():
        for key in names:
            if key in saved and compared[key] != current[key]:
                problems.append(f"{flag(key, current[key])} differs from the checkpoint's {shown(saved[key])} "
                                f"({held_by}): "
                                f"resume with {flag(key, saved[key])}, {fresh}.")
    if saved["global_batch"] != current["global_batch"]:
        problems.append(f"this launch's global batch is {current['global_batch']} and {checkpoint} was trained with "
                        f"{saved['global_batch']} (the order of the rows it continues follows it): resume with "
                        f"--global_batch_size {saved['global_batch']}, {fresh}.")
    elif saved.get("world_size", current.get("world_size")) != current.get("world_size"):
        notes.append(world_size_change(saved, current, step))
    elif (saved["micro_batch"], saved["accumulation"]) != (current["micro_batch"], current["accumulation"]):
        notes.append(f"micro-batch {current['micro_batch']} x {current['accumulation']} accumulation where the "
                     f"checkpoint had {saved['micro_batch']} x {saved['accumulation']}: the same global batch of "
                     f"{current['global_batch']}, the same losses")
    explicit = current["explicit_max_steps"]
    if explicit > 0 and explicit != saved["max_steps"]:
        if step > explicit:
            problems.append(f"{checkpoint} is at step {step}, past --max_steps {explicit}: nothing would train. Resume "
                            f"with --max_steps {saved['max_steps']} (the run's length), or export it "
                            f"(scripts/export_hf.py {checkpoint}).")
        elif current["lr_scheduler_type"] == "constant":
            notes.append(f"training to step {explicit} where the checkpoint's run went to {saved['max_steps']} (the "
                         "constant schedule is the same)")
        else:
            problems.append(f"--max_steps {explicit} differs from the checkpoint's run of {saved['max_steps']} steps, "
                            f"over which its {current['lr_scheduler_type']} schedule runs"
                            f"{lr_jump(saved, explicit, step)}: resume with --max_steps "
                            f"{saved['max_steps']}, {fresh}.")
    if problems:
        raise ConfigError(problems)
    return notes


def tensor_parallel_change(checkpoint: str, saved: dict, current: dict, fresh: str) -> str:
    """What a resume under another tp_size gets. FSDP2's sharded state (torch.distributed.checkpoint) holds each
    weight and optimizer state by its place in the whole tensor, and loads into any (dp_shard, tp) mesh: measured,
    a tp 2 x dp_shard 2 checkpoint resumed under FSDP2 alone on the same 4 ranks trains on to the same losses.
    Other layouts hold whole tensors per rank: refused."""
    had, has = saved.get("tp_size", 1), current.get("tp_size", 1)
    if saved["strategy"] == "fsdp":
        return (f"tensor parallelism over {has} rank(s) where the checkpoint had {had}: torch.distributed.checkpoint "
                "reshards its FSDP2 states")
    return (f"{checkpoint} was saved with tp_size {had} and this launch has tp_size {has}: outside FSDP2 a "
            f"checkpoint holds each rank's own tensors. Resume with parallelism_config_tp_size {had}, {fresh}.")


def world_size_change(saved: dict, current: dict, step: int) -> str:
    """What a resume on another number of processes changes and keeps. DDP's states are whole on every rank;
    FSDP2's sharded state dict is torch.distributed.checkpoint's, which reshards each tensor to the new mesh on
    load; DeepSpeed's ZeRO partitions are converted to its universal checkpoint (shardtune.checkpoint.universal,
    the launches it supports: deepspeed_resize_problem). The data order is the
    seeded shuffle of the rows, cut into global batches of consecutive rows whatever the ranks
    (batches.global_batches), so the same global batch continues from the same row."""
    def split(settings: dict) -> str:
        ranks = settings["global_batch"] // (settings["micro_batch"] * settings["accumulation"])
        return f"micro-batch {settings['micro_batch']} x {settings['accumulation']} accumulation x {ranks} data ranks"

    states = {"fsdp": "FSDP2 states resharded by torch.distributed.checkpoint",
              "deepspeed": "ZeRO states through DeepSpeed's universal checkpoint, converted once"}.get(
        current["strategy"], "every rank loads the whole model and optimizer states")
    # accelerate's load_state restores rank i's random streams from the checkpoint's file of rank i, if it has one
    added = current["world_size"] - saved["world_size"]
    streams = f"; ranks {saved['world_size']} to {current['world_size'] - 1} start their random streams from " \
        "--seed" if added > 0 else ""
    processes = f"{current['world_size']} process{'es' if current['world_size'] > 1 else ''}"
    return (f"{processes} where the checkpoint had {saved['world_size']}: {split(current)} "
            f"where it had {split(saved)}; kept: the global batch of {current['global_batch']}, the data order "
            f"after the {step * current['global_batch']} rows of its {step} steps, the schedule and the optimizer's "
            f"step count ({states}{streams})")


def check_resumed_length(checkpoint: str, saved: dict, max_steps: int) -> None:
    """Where the run's length comes from its epochs: the data must give the checkpoint's run its length again."""
    if saved and saved["explicit_max_steps"] <= 0 and max_steps != saved["max_steps"]:
        raise ConfigError(f"{checkpoint} was trained for {saved['max_steps']} steps and this run's data makes "
                          f"{max_steps}: the data changed. Resume with the data it was trained on, or start a new run "
                          f"from its weights (scripts/export_hf.py {checkpoint}).")


def lr_jump(saved: dict, steps: int, at: int) -> str:
    """", so the learning rate after step N would be X instead of Y": the checkpoint's schedule over `steps` and
    over its own length, from transformers' own schedule functions."""
    from shardtune.schedule import learning_rate_at

    recipe = Recipe(**{key: saved[key] for key in ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs",
                                                    "warmup_ratio", "warmup_steps")})
    return (f", so the learning rate after step {at} would be {learning_rate_at(recipe, steps, at):.3g} instead of "
            f"{learning_rate_at(recipe, saved['max_steps'], at):.3g}")


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: a checkpoint (`path`, its `step`, the settings its marker records) or step 0, and the
    lines that say what the resume carries over."""

    path: str | None = None
    step: int = 0
    saved: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    universal: bool = False  # a DeepSpeed checkpoint of another world size: loaded as DeepSpeed's universal form


# DeepSpeed launches that resume on another number of processes through the universal checkpoint: ZeRO-1, 2 and 3,
# ZeRO-3 with its optimizer (and parameters) in CPU RAM, measured equal to the uninterrupted run
# (tests/launch/test_resume_resized.py); not NVMe offload, the sequence split or ZeRO++'s hpZ.
UNIVERSAL_STAGES = (1, 2, 3)
# Why NVMe offload cannot: DeepSpeed 0.19's load_checkpoint (runtime/engine.py) skips the ZeRO optimizer files, the
# universal ones included, when the optimizer is on NVMe, and copies back each rank's own swap files instead.
NVME_REASON = ("DeepSpeed 0.19 restores NVMe-offloaded optimizer states from each rank's own swap files "
               "(offloaded_tensors/rank<N>, cut for the ranks that saved them), never from the universal checkpoint")


def deepspeed_resize_problem(checkpoint: str, saved_world: int, launch: LaunchDescription) -> str | None:
    """Why this DeepSpeed launch cannot resume a checkpoint of `saved_world` processes, or None."""
    settings = launch.deepspeed_settings
    nvme = "nvme" in (settings.get("offload_optimizer"), settings.get("offload_param"))
    unsupported = [what for what, applies in (
        (f"under ZeRO-{settings.get('stage')}", settings.get("stage") not in UNIVERSAL_STAGES),
        ("with the sequence split", launch.sp_size > 1),
        ("with ZeRO++'s hpZ", settings.get("hpz_partition", 1) > 1)) if applies]
    if not unsupported and not nvme:
        return None
    why = f"with states offloaded to NVMe is not supported: {NVME_REASON}" if nvme else (
        f"{' and '.join(unsupported)} is not supported yet (not measured; ZeRO-1, 2 and 3, with or without CPU "
        "offload, resume through DeepSpeed's universal checkpoint)")
    return (f"{checkpoint} was saved by {saved_world} processes and this DeepSpeed launch has {launch.world_size}: "
            f"a resume on another number of processes {why}. Resume with --num_processes "
            f"{saved_world}, or start a new run from its weights (scripts/export_hf.py {checkpoint}).")


def resume_point(recipe: Recipe, launch: LaunchDescription, batching: BatchSizes) -> ResumePoint:
    """--resume_from_checkpoint resolved and checked against this launch; raises ConfigError before any loading."""
    path, step = resolve_resume(recipe.resume_from_checkpoint, recipe.resolved_output_dir, launch.world_size)
    if path is None:
        return ResumePoint()
    marker = read_marker(path)
    # Markers written before the run recorded its world size hold it beside the run's settings only.
    saved = {"world_size": marker["world_size"], **marker["run"]} if marker.get("run") else {}
    notes = check_resume_settings(path, step, saved, run_settings(recipe, launch, batching))
    universal = launch.uses_deepspeed and marker["world_size"] != launch.world_size
    if universal and (problem := deepspeed_resize_problem(path, marker["world_size"], launch)):
        raise ConfigError(problem)
    if universal:  # what the conversion would delete first must be its own (DeepSpeed launches only: a heavy import)
        from shardtune.checkpoint.universal import conversion_leftovers, leftover_problem

        problems = [problem for leftover in conversion_leftovers(path, recipe.resolved_output_dir)
                    if (problem := leftover_problem(leftover))]
        if problems:
            raise ConfigError(problems)
    return ResumePoint(path, step, saved, tuple(notes), universal)

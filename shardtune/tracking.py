"""Where metrics go: `output_dir/metrics.jsonl` always, W&B through accelerate's tracker when asked; and what the
trainer reports there: the first step's held bytes and compilation, each logging window."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import uuid

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from shardtune.checkpoint.output_dir import METRICS_FILE, RUN_CONFIG_FILE, SAMPLES_FILE
from shardtune.config import Recipe
from shardtune.data.sources import dataset_sources
from shardtune.launch import LaunchDescription
from shardtune.levers.compile import compile_figures
from shardtune.memory import COMPONENTS, ModelStateProbe

# what `accelerate launch` exports from its config file and flags
LAUNCH_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")


def start_tracking(accelerator: Accelerator, recipe: Recipe, launch: LaunchDescription, resumed: bool) -> None:
    """What the run is, in output_dir/run_config.json and as the W&B run's config; then W&B through accelerate.
    The run id lives in output_dir, so a resumed run continues the same W&B run."""
    config = run_config(accelerator, recipe, launch)
    if accelerator.is_main_process:
        with open(os.path.join(recipe.resolved_output_dir, RUN_CONFIG_FILE), "w") as file:
            json.dump(config, file, indent=2, allow_nan=False)
            file.write("\n")
    if recipe.report_to != "wandb":
        return
    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")  # a real, syncable run under output_dir/wandb
    id_file = os.path.join(recipe.resolved_output_dir, "wandb_run_id")
    if accelerator.is_main_process:
        if not (resumed and os.path.isfile(id_file)):
            with open(id_file, "w") as file:
                file.write(uuid.uuid4().hex[:8])
        with open(id_file) as file:
            run_id = file.read().strip()
    accelerator.init_trackers(
        recipe.wandb_project,
        config=config,
        init_kwargs={"wandb": wandb_init_kwargs(recipe, run_id)} if accelerator.is_main_process else {},
    )


def wandb_init_kwargs(recipe: Recipe, run_id: str) -> dict:
    """wandb.init's arguments beside the project: the run's files under output_dir, its name (--run_name, else
    --name), and the id that a resumed run continues."""
    return {"dir": recipe.resolved_output_dir, "name": recipe.run_name or recipe.name, "id": run_id,
            "resume": "allow"}


def run_config(accelerator: Accelerator, recipe: Recipe, launch: LaunchDescription) -> dict:
    """The resolved recipe, the accelerate configuration this process runs under and the memory plan, as JSON
    values. `accelerate launch` does not pass the --config_file path (nor its contents) to the script: it turns
    the file into ACCELERATE_* / FSDP_* variables, which are therefore the effective config recorded here, with
    DeepSpeed's resolved JSON config (its "auto" values filled in by `prepare`)."""
    plan, why_none = memory_plan(recipe, launch)
    config = {"recipe": recorded_recipe(recipe), "accelerate": accelerate_config(accelerator),
              "parallelism": launch.parallelism_sizes, "memory_plan": plan}
    if plan is None:
        config["memory_plan_absent"] = why_none
    return json_values(config)


def recorded_recipe(recipe: Recipe) -> dict:
    """The recipe's fields, with the local paths among them absolute: the record must say which model and data
    a run used wherever it is read from, not relative to a working directory it does not state. Hub names (no
    such local path) stay as given."""
    fields = dataclasses.asdict(recipe)
    fields["model_name_or_path"] = absolute_if_local(recipe.model_name_or_path)
    fields["dataset"] = ",".join(absolute_if_local(source) for source in dataset_sources(recipe.dataset))
    fields["eval_split"] = absolute_if_local(recipe.eval_split)  # a file, or a split's name
    fields["chat_template"] = absolute_if_local(recipe.chat_template)  # a file, or a bundled template's name
    fields["output_dir"] = os.path.abspath(recipe.resolved_output_dir)
    return fields


def absolute_if_local(name: str) -> str:
    return os.path.abspath(name) if name and os.path.exists(name) else name


def json_values(value):
    """`value` as strict JSON values: paths and dtypes as text, infinities (DeepSpeed's steps_per_print) as
    "inf" (JSON has no Infinity; Python would write one that other readers refuse)."""
    if isinstance(value, dict):
        return {str(key): json_values(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_values(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def accelerate_config(accelerator: Accelerator) -> dict:
    environment = {name: value for name, value in sorted(os.environ.items()) if name.startswith(LAUNCH_PREFIXES)}
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    return {"distributed_type": accelerator.distributed_type.value, "num_processes": accelerator.num_processes,
            "num_machines": max(1, accelerator.num_processes // max(1, per_node)),
            "mixed_precision": accelerator.mixed_precision, "environment": environment,
            "deepspeed_config": accelerator.state.deepspeed_plugin.deepspeed_config if deepspeed else None}


def memory_plan(recipe: Recipe, launch: LaunchDescription) -> tuple[dict | None, str | None]:
    """The planner's per-GPU plan of this launch (as the start-up line prints it), or None and why."""
    from shardtune.models.flops import ModelError, resolve_model
    from shardtune.plan.hardware import HardwareError
    from shardtune.plan.launched import launch_hardware, plan_launch

    try:
        hardware = launch_hardware(recipe.hardware, launch)
        if hardware is None:
            return None, "no GPU visible and no --hardware given: nothing to plan against"
        shape = resolve_model(recipe.model_name_or_path)
    except (HardwareError, ModelError) as error:
        return None, str(error)
    return plan_launch(shape, hardware, recipe, launch.strategy(recipe.mixed_precision))[0].to_json(), None


def truncate_metrics(output_dir: str, after_step: int) -> None:
    """Drop metrics and samples logged after `after_step`: a resumed run logs those steps again."""
    for name in (METRICS_FILE, SAMPLES_FILE):
        path = os.path.join(output_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path) as file:
            rows = [line for line in file if json.loads(line)["step"] <= after_step]
        with open(path, "w") as file:
            file.writelines(rows)


def log_metrics(accelerator: Accelerator, output_dir: str, step: int, metrics: dict[str, float]) -> None:
    """One JSON object per call in metrics.jsonl (main process), and the same values to the trackers."""
    accelerator.log(metrics, step=step)
    if accelerator.is_main_process:
        with open(os.path.join(output_dir, METRICS_FILE), "a") as file:
            file.write(json.dumps({"step": step, **metrics}) + "\n")


def log_samples(accelerator: Accelerator, output_dir: str, step: int, samples: list[dict[str, str]]) -> None:
    """Generated samples: one JSON object each in samples.jsonl, and a W&B table (one per eval, under
    `samples`) when W&B tracks the run. Main process only."""
    if not accelerator.is_main_process:
        return
    with open(os.path.join(output_dir, SAMPLES_FILE), "a") as file:
        for sample in samples:
            file.write(json.dumps({"step": step, **sample}) + "\n")
    if any(tracker.name == "wandb" for tracker in accelerator.trackers):
        columns = ["step", *samples[0]]
        accelerator.get_tracker("wandb").log_table(
            "samples", columns=columns, data=[[step, *sample.values()] for sample in samples], step=step)



def report_held(accelerator: Accelerator, output_dir: str, step: int, probe: ModelStateProbe,
                loaded: dict[str, int]) -> None:
    """What the ranks really held at the first step (checked against the planner's model states: max over
    ranks), and per rank what it held right after loading the weights (only rank 0 reads them under FSDP)."""
    loading = ("parameter_bytes", "peak_rss_bytes", "loading_rss_bytes")
    local = [probe.held[key] for key in COMPONENTS] + [loaded[key] for key in loading]
    per_rank = accelerator.gather(torch.tensor(local, dtype=torch.float64, device=accelerator.device))
    per_rank = per_rank.view(-1, len(local)).tolist()
    held = {f"held_{key}_bytes": int(max(rank[index] for rank in per_rank)) for index, key in enumerate(COMPONENTS)}
    for rank, values in enumerate(per_rank):
        held.update({f"loaded_{key}_rank{rank}": int(value) for key, value in zip(loading, values[-3:], strict=True)})
    accelerator.print("shardtune: held per rank (max over ranks): "
                      + ", ".join(f"{key} {held[f'held_{key}_bytes'] / 2**30:.3f} GiB" for key in COMPONENTS))
    log_metrics(accelerator, output_dir, step, held)


def report_compiled(accelerator: Accelerator, recipe: Recipe) -> None:
    """The first step's compilation, once: the layers compile in their first forward and backward."""
    figures = compile_figures(accelerator)
    accelerator.print(f"shardtune: torch.compile ({recipe.torch_compile_backend}) of the decoder layers: "
                      f"{figures['compile_seconds']:.1f}s in the first step, {figures['compiled_frames']:.0f} "
                      "frames compiled (the slowest rank)")


def log_window(accelerator: Accelerator, output_dir: str, step: int, row: dict[str, float], progress: tqdm) -> None:
    progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tokens_per_second']:.0f}")
    log_metrics(accelerator, output_dir, step, row)

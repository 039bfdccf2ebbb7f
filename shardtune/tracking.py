"""Where metrics go: `output_dir/metrics.jsonl` always, W&B through accelerate's tracker when asked."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import uuid

import torch
from accelerate import Accelerator

from shardtune.config import Recipe


def start_tracking(accelerator: Accelerator, recipe: Recipe, resumed: bool) -> None:
    """W&B through accelerate. The run id lives in output_dir, so a resumed run continues the same W&B run."""
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
        config=dataclasses.asdict(recipe),
        init_kwargs={"wandb": {"dir": recipe.resolved_output_dir, "name": recipe.run_name or recipe.name,
                               "id": run_id, "resume": "allow"}} if accelerator.is_main_process else {},
    )


def truncate_metrics(output_dir: str, after_step: int) -> None:
    """Drop rows logged after `after_step`: a resumed run logs those steps again."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    with open(path) as file:
        rows = [line for line in file if json.loads(line)["step"] <= after_step]
    with open(path, "w") as file:
        file.writelines(rows)


def log_metrics(accelerator: Accelerator, output_dir: str, step: int, metrics: dict[str, float]) -> None:
    """One JSON object per call in metrics.jsonl (main process), and the same values to the trackers."""
    accelerator.log(metrics, step=step)
    if accelerator.is_main_process:
        with open(os.path.join(output_dir, "metrics.jsonl"), "a") as file:
            file.write(json.dumps({"step": step, **metrics}) + "\n")


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """Peak allocated GPU memory on CUDA; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}

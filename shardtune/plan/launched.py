"""The plan of a recipe as launched: under the launch's strategy, on the hardware named or found, with the
fastest plan that fits when it does not."""

from __future__ import annotations

from shardtune.config import Recipe
from shardtune.launch import LaunchDescription
from shardtune.models.flops import ModelShape
from shardtune.plan.hardware import Hardware, nominal_gpu_memory, parse_hardware
from shardtune.plan.planned_run import HELD_OPTIMIZER, plan_recipe, recipe_search
from shardtune.plan.planner import MemoryPlan
from shardtune.plan.search import recommend
from shardtune.plan.strategy import Strategy, read_accelerate_config


def launch_hardware(spec: str, launch: LaunchDescription) -> Hardware | None:
    """`--hardware NAME`, or the GPUs this process sees (nodes from the launch's world size over its local world
    size) with this node's RAM, each GPU's memory read by the CLI's rule (nominal_gpu_memory)."""
    if spec:
        return parse_hardware(spec)
    import psutil
    import torch

    if not torch.cuda.is_available():
        return None
    per_node, nodes = launch.local_world_size, launch.num_machines
    name = torch.cuda.get_device_name(0)
    memory = nominal_gpu_memory(torch.cuda.get_device_properties(0).total_memory)
    return Hardware(nodes, per_node, memory, name, f"{nodes}x{per_node}x {name} ({memory / 1e9:.0f} GB)",
                    float(psutil.virtual_memory().total))


def launch_strategy(recipe: Recipe, launch: LaunchDescription, config_file: str | None = None) -> Strategy:
    """The launch's strategy under the recipe's precision, or `config_file`'s, for a dry run outside
    `accelerate launch`."""
    if config_file:
        return read_accelerate_config(config_file, recipe.mixed_precision)
    return launch.strategy(recipe.mixed_precision)


def plan_launch(shape: ModelShape, hardware: Hardware, recipe: Recipe, strategy: Strategy
                ) -> tuple[MemoryPlan, str | None]:
    """The plan of a recipe under `strategy` (launch_strategy); with the fastest plan that fits this hardware
    when it does not (None when it does), after what to change where a whole live DPO reference binds."""
    chosen = plan_recipe(shape, hardware, strategy, recipe)
    if chosen.fits:
        return chosen, None
    found = recommend(shape, hardware, recipe_search(recipe, hardware, recipe.mixed_precision, HELD_OPTIMIZER))
    # A whole live DPO reference that does not fit: what to change, before the search's answer.
    advice = chosen.reference_advice
    advice = f"{advice[0].upper()}{advice[1:]} " if advice else ""
    return chosen, advice + (f"The fastest plan that fits: {found.message}" if found.plan else found.message)

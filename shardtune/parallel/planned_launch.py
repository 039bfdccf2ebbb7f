"""The launch a --dry_run plans: the variables a process of `accelerate launch --config_file <config>` would see,
as accelerate's own launcher builds them, and os.environ set to them while the start-up checks read the launch."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

from shardtune.config import ConfigError
from shardtune.plan.strategy import tensor_parallel_launch_args


def planned_launch_environment(config_file: str, nodes: int, gpus_per_node: int) -> dict[str, str]:
    """The variables a process of `accelerate launch --config_file <config_file>` on `nodes` nodes of
    `gpus_per_node` GPUs would see, as accelerate's own launcher builds them (commands/launch.py and
    utils/launch.py), with torchrun's WORLD_SIZE, LOCAL_WORLD_SIZE and RANK of its first process: the launch that a
    --dry_run plans, which its checks then read as a launched run reads its own (LaunchDescription.from_env).
    Raises ConfigError where accelerate's launcher would refuse the file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    world = nodes * gpus_per_node
    args = launch_command_parser().parse_args([
        "--config_file", config_file, "--num_processes", str(world), "--num_machines", str(nodes),
        "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port", "29500",
        *tensor_parallel_launch_args(config_file, world), "recipe.py"])
    logging.getLogger("accelerate.commands.launch").setLevel(logging.ERROR)  # its notes on defaults it fills
    try:
        args, defaults, precision_from_config = _validate_launch_command(args)
        if args.use_deepspeed:  # as launch_command does before it hands over to the DeepSpeed launcher
            fields = [*(defaults.deepspeed_config if defaults else ())] + ["mixed_precision"] * precision_from_config
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, env = prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.multi_gpu:
            env = prepare_multi_gpu_env(args)
        else:
            _, env = prepare_simple_launcher_cmd_env(args)
    except (ValueError, TypeError, KeyError, OSError) as error:
        raise ConfigError(f"accelerate launch refuses --config_file {config_file}: "
                          f"{' '.join(str(error).split())}") from None
    planned = {name: value for name, value in env.items() if os.environ.get(name) != value}
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **planned, "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(gpus_per_node), "RANK": "0", "LOCAL_RANK": "0"}


@contextlib.contextmanager
def launch_environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ as a planned launch's process sees it (planned_launch_environment), restored afterwards: every
    check reads the planned launch where it reads a real one. The variables of this shell's own launch (if any)
    are dropped meanwhile."""
    saved = dict(os.environ)
    for name in [*os.environ]:
        if name.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            del os.environ[name]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)

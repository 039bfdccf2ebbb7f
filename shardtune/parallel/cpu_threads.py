"""OpenMP threads per rank for an accelerate config: its share of the node's cores when the optimizer steps on the
CPU (DeepSpeed's CPU Adam for an optimizer offloaded to cpu or nvme, FSDP's AdamW on offloaded parameters), else 1.

    OMP_NUM_THREADS=$(python -m shardtune.parallel.cpu_threads --ranks_per_node 8 \\
        accelerate_configs/ds_zero3_offload_optimizer.yaml) \\
    accelerate launch --config_file accelerate_configs/ds_zero3_offload_optimizer.yaml recipes/llama70b.py

Give it as OMP_NUM_THREADS, not as `accelerate launch --num_cpu_threads_per_process`: accelerate's DeepSpeed path
never reads that flag, and torchrun then gives every rank OMP_NUM_THREADS=1 (its default when the variable is unset).
scripts/slurm/train.sbatch runs this with the job's cores and ranks per node.
"""

from __future__ import annotations

import argparse
import os
import sys

from shardtune.plan.strategy import PlanError, Strategy, read_accelerate_config


def optimizer_steps_on_cpu(strategy: Strategy) -> bool:
    """The optimizer states live in host memory (or NVMe, swapped through it): the step runs on the CPU."""
    return strategy.offload_optimizer != "none"


def threads_per_rank(config_file: str, ranks_per_node: int, cpus_per_node: int) -> int:
    """cpus_per_node // ranks_per_node (at least 1) where `config_file` steps the optimizer on the CPU, else 1: the
    ranks' forward and backward run on GPUs, and more threads there only contend."""
    if not optimizer_steps_on_cpu(read_accelerate_config(config_file)):
        return 1
    return max(1, cpus_per_node // ranks_per_node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardtune.parallel.cpu_threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("config_file", help="The accelerate config YAML (and the DeepSpeed JSON file it names).")
    parser.add_argument("--ranks_per_node", type=int, required=True, help="Processes launched on each node.")
    parser.add_argument("--cpus_per_node", type=int, default=os.cpu_count() or 1,
                        help="Cores each node gives the job (SLURM_CPUS_ON_NODE under SLURM). (default: this "
                             "machine's)")
    args = parser.parse_args(argv)
    if args.ranks_per_node < 1 or args.cpus_per_node < 1:
        return refuse(f"--ranks_per_node and --cpus_per_node must be >= 1, got {args.ranks_per_node} and "
                      f"{args.cpus_per_node}.")
    try:
        print(threads_per_rank(args.config_file, args.ranks_per_node, args.cpus_per_node))
    except PlanError as error:
        return refuse(f"{error}; give an accelerate config, e.g. accelerate_configs/ds_zero3.yaml.")
    return 0


def refuse(message: str) -> int:
    print(f"shardtune.parallel.cpu_threads: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

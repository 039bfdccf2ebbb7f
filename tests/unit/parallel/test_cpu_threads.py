"""OpenMP threads per rank where the optimizer steps on the CPU, for every shipped accelerate config: as
scripts/slurm/train.sbatch sets them, and as the recipes' launch lines do.

The SLURM script runs without a cluster, as a job's batch shell would, with `srun` and `scontrol` on PATH replaced
by stand-ins that record what the job's step would be started with (tests/launch/test_slurm.py runs it under a real
SLURM). The script's plan of each attempt (the recipe's --dry_run on the nodes it got) is stood in for too: it is
recorded, not run (its refusals are the planner's, tested with it; tests/launch/test_slurm.py runs it for real). A
recipe's launch line is run by bash up to `accelerate launch`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, REPO, TINY_RECIPE

SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
CPUS_ON_NODE, PROCS_PER_NODE = 96, 8
# The configs whose optimizer steps on the CPU: its states offloaded to CPU RAM or NVMe (DeepSpeed's CPU Adam), or
# FSDP's parameters offloaded with them. Every other config steps on the GPU.
CPU_OPTIMIZER_STEP = {"ds_zero3_cpu_offload", "ds_zero3_nvme_offload", "ds_zero3_offload_optimizer",
                      "ds_zero3_offload_optimizer_ulysses", "fsdp_full_shard_cpu_offload"}
SHIPPED = sorted(path.stem for path in CONFIGS.glob("*.yaml"))
STAND_INS = {
    "srun": '#!/bin/sh\necho "step environment: OMP_NUM_THREADS=$OMP_NUM_THREADS"\necho "step command: $*"\n',
    "scontrol": "#!/bin/sh\necho node-a\necho node-b\n",
    # The plan's --dry_run recorded; every other Python command (shardtune.parallel.cpu_threads) run.
    "python": f'#!/bin/sh\ncase " $* " in *" --dry_run "*) echo "plan command: $*"; exit 0;; esac\n'
              f'exec {sys.executable} "$@"\n',
}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bin")
    for name, text in STAND_INS.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def run_job(config: str, stand_ins: Path, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "OMP_"))}
    env.update({"PATH": f"{stand_ins}:{Path(sys.executable).parent}:{env['PATH']}", "PYTHONPATH": str(REPO),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "shardtune", "SLURM_JOB_NODELIST": "node-[a-b]",
                "SLURM_NNODES": "2", "SLURM_CPUS_ON_NODE": str(CPUS_ON_NODE),
                "SHARDTUNE_PROCS_PER_NODE": str(PROCS_PER_NODE), "SHARDTUNE_LOG_DIR": str(tmp_path / "logs"),
                **extra})
    return subprocess.run(["bash", str(SCRIPT), str(TINY_RECIPE), config], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_every_shipped_config_is_judged():
    assert CPU_OPTIMIZER_STEP < set(SHIPPED) and len(SHIPPED) == 16


@pytest.mark.parametrize("config", SHIPPED)
def test_threads_per_rank_follow_where_the_optimizer_steps(config, stand_ins, tmp_path):
    result = run_job(str(CONFIGS / f"{config}.yaml"), stand_ins, tmp_path, OMP_NUM_THREADS="5")
    assert result.returncode == 0, result.stderr
    threads = CPUS_ON_NODE // PROCS_PER_NODE if config in CPU_OPTIMIZER_STEP else 1
    # The environment srun hands to every node, whatever the submitting shell had: accelerate launch and torchrun
    # pass it on to the ranks.
    assert f"step environment: OMP_NUM_THREADS={threads}\n" in result.stdout, result.stdout
    assert f"OMP_NUM_THREADS={threads} per rank" in result.stdout
    assert "--num_processes 16" in result.stdout and "--main_process_ip node-a" in result.stdout
    assert f"--dry_run --config_file {CONFIGS / config}.yaml --hardware 2x8xh100-80gb" in result.stdout


def test_hybrid_sharding_replicates_across_the_jobs_nodes(stand_ins, tmp_path):
    """fsdp_hybrid_shard.yaml is written for 2 nodes of 8: a job of 3 nodes of 4 ranks meshes 3 x 4."""
    result = run_job(str(CONFIGS / "fsdp_hybrid_shard.yaml"), stand_ins, tmp_path, SLURM_NNODES="3",
                     SHARDTUNE_PROCS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    assert "--num_processes 12" in result.stdout and "--hardware 3x4xh100-80gb" in result.stdout
    assert "--parallelism_config_dp_replicate_size 3 --parallelism_config_dp_shard_size 4" in result.stdout
    plain = run_job(str(CONFIGS / "fsdp_full_shard.yaml"), stand_ins, tmp_path)
    assert "parallelism_config" not in plain.stdout


def test_tensor_parallelism_splits_within_each_node_and_shards_across_nodes(stand_ins, tmp_path):
    """fsdp_tp.yaml is written for 2 nodes of 8: a job of 3 nodes of 4 ranks splits its layers over each node's 4
    ranks and shards over the 3 nodes."""
    result = run_job(str(CONFIGS / "fsdp_tp.yaml"), stand_ins, tmp_path, SLURM_NNODES="3", SHARDTUNE_PROCS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    assert "--num_processes 12" in result.stdout
    assert "--parallelism_config_tp_size 4 --parallelism_config_dp_shard_size 3" in result.stdout


def test_context_parallelism_splits_sequences_within_each_node_and_data_across_nodes(stand_ins, tmp_path):
    """fsdp_cp.yaml is written for one node of 8: a job of 3 nodes of 4 ranks cuts each sequence over each node's
    4 ranks, its rows dealt over the 3 nodes."""
    result = run_job(str(CONFIGS / "fsdp_cp.yaml"), stand_ins, tmp_path, SLURM_NNODES="3", SHARDTUNE_PROCS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    assert "--num_processes 12" in result.stdout
    assert "--parallelism_config_cp_size 4 --parallelism_config_dp_shard_size 3" in result.stdout


def test_a_plan_that_refuses_the_nodes_stops_the_job_before_srun(stand_ins, tmp_path):
    """The attempt's plan run for real (the stand-in Python removed): the tiny recipe's global batch of 32 cannot be
    made by 2 nodes of 8 ranks at its micro-batch of 16, so the job ends with the planner's line and code 2."""
    planned = tmp_path / "bin"
    shutil.copytree(stand_ins, planned)
    (planned / "python").unlink()
    result = run_job(str(CONFIGS / "ddp.yaml"), planned, tmp_path)
    assert result.returncode == 2 and "step command" not in result.stdout
    assert "--global_batch_size 32 is not divisible by per_device_train_batch_size x processes" in result.stderr
    assert "the plan on 2x8xh100-80gb refused this launch (above): not launched" in result.stderr


def test_an_unreadable_config_stops_the_job_before_srun(stand_ins, tmp_path):
    result = run_job(str(tmp_path / "nothere.yaml"), stand_ins, tmp_path)
    assert result.returncode == 2
    assert "step command" not in result.stdout
    assert result.stderr.splitlines() == [
        f"shardtune.parallel.cpu_threads: error: Cannot read accelerate config '{tmp_path}/nothere.yaml': [Errno 2] "
        f"No such file or directory: '{tmp_path}/nothere.yaml'; give an accelerate config, e.g. "
        "accelerate_configs/ds_zero3.yaml."]


RECIPES = sorted((REPO / "recipes").glob("*.py"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_a_recipe_launch_line_sets_threads_where_its_config_steps_on_the_cpu(recipe):
    header = recipe.read_text().split('"""')[1]
    config = re.search(r"accelerate launch --config_file (accelerate_configs/\w+\.yaml)", header).group(1)
    ranks_per_node = 8
    # The line's prefix, as bash runs it: the thread count it gives accelerate launch.
    prefix = re.search(r"^ *(OMP_NUM_THREADS=\$\(.*?\)) \\\n *accelerate launch", header, re.S | re.M)
    if Path(config).stem not in CPU_OPTIMIZER_STEP:
        assert prefix is None and "OMP_NUM_THREADS" not in header
        return
    assert prefix, f"{recipe.name}: its launch line must give OMP_NUM_THREADS (shardtune.parallel.cpu_threads)"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    result = subprocess.run(["bash", "-c", f"{prefix.group(1)}; echo $OMP_NUM_THREADS"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr, result.stderr
    assert int(result.stdout) == max(1, (os.cpu_count() or 1) // ranks_per_node)
    assert f"--ranks_per_node {ranks_per_node} " in prefix.group(1) and config in prefix.group(1)

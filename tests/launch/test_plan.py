"""The planner's command line run as users run it (JSON, a bad hardware name, a Hub model planned from its
config.json alone) and the async-save staging it plans against what each rank of a launch writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.models.flops import resolve_model
from shardtune.plan.hardware import Hardware
from shardtune.plan.planner import plan
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config
from tests.conftest import REPO

MISSION_PARAMS = {
    "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800, "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
}


def config(name: str):
    return read_accelerate_config(os.path.join(CONFIGS_DIR, f"{name}.yaml"))


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtune.plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=env)


def test_cli_json_and_bad_hardware():
    result = run_cli("--model", "llama-3.1-8b", "--config_file", os.path.join(CONFIGS_DIR, "fsdp_full_shard.yaml"),
                     "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {"params", "per_gpu", "host_ram_per_node", "capacity", "fits"} <= data.keys()
    assert {"weights", "gradients", "optimizer", "activations", "buffers", "total"} <= data["per_gpu"].keys()
    assert data["params"] == MISSION_PARAMS["llama-3.1-8b"]

    bad = run_cli("--model", "llama-3.1-8b", "--hardware", "8xh100")
    assert bad.returncode != 0
    errors = [line for line in bad.stderr.splitlines() if line.startswith("shardtune.plan: error")]
    assert len(errors) == 1 and "NxMEMgb" in errors[0]


def test_any_hub_model_plans_from_its_config_json_alone(tiny_assets, tmp_path):
    """A Hub id that is not built in: only config.json is fetched (here from a Hub cache laid out as
    huggingface_hub writes it, offline); offline and not cached, one line that says so and lists the built-ins."""
    snapshot = tmp_path / "hub" / "models--acme--tiny-chat" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(Path(tiny_assets[0]) / "config.json", snapshot / "config.json")
    (tmp_path / "hub" / "models--acme--tiny-chat" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-chat" / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    # The tiny config's context is 256 positions: the planner refuses its default length there, as the recipe does.
    found = run_cli("--model", "acme/tiny-chat", "--max_seq_length", "256", "--json", env=env)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["params"] == resolve_model(tiny_assets[0]).params
    missing = run_cli("--model", "acme/other-model", env=env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.count("\n") == 1 and "HF_HUB_OFFLINE=1" in missing.stderr
    assert "llama-3.1-70b" in missing.stderr


# ---------------------------------------------------------------------------------------------------------------
# Activation calibration: count unique storages saved for backward in one forward of a tiny Llama.


@pytest.mark.parametrize("config", ["fsdp_full_shard", "ds_zero3", "ddp"])
def test_async_save_staging_is_the_checkpoint_each_rank_writes(config, reference_run, tiny_assets):
    """--async_save copies each rank's share of the checkpoint to host memory: the planner's staging bytes per node
    (2 ranks here) equal the model and optimizer files of a real checkpoint of the same run, to within its
    metadata and Adam's step counters."""
    checkpoint = reference_run(config) / "checkpoint-2"
    if config.startswith("fsdp"):  # torch.distributed.checkpoint: the tensors' bytes from its metadata
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entries = [entry for name in ("pytorch_model_fsdp_0", "optimizer_0")
                   for entry in FileSystemReader(str(checkpoint / name)).read_metadata().state_dict_metadata.values()]
        written = sum(entry.size.numel() * entry.properties.dtype.itemsize for entry in entries
                      if isinstance(entry, TensorStorageMetadata))
    else:  # DeepSpeed's partition files, DDP's model.safetensors and optimizer.bin
        files = [*(checkpoint / "pytorch_model").glob("*"), checkpoint / "model.safetensors",
                 checkpoint / "optimizer.bin"]
        written = sum(path.stat().st_size for path in files if path.is_file())
    strategy = read_accelerate_config(os.path.join(CONFIGS_DIR, f"{config}.yaml"), mixed_precision="no")
    hardware = Hardware(1, 2, 80 * 10**9, name="2 ranks")
    planned = plan(resolve_model(tiny_assets[0]), hardware, strategy, 1, 64, False, async_save=True)
    print(config, "planned", planned.host_ram["checkpoint_staging"], "written", written)
    assert planned.host_ram["checkpoint_staging"] == pytest.approx(written, rel=0.05)





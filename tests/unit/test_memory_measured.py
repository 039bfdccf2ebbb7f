"""The DeepSpeed JSON read alike by accelerate, the planner and the start-up checks, and a bad stage or offload
device in it refused. The held states each launched rank measures against the planner are in
tests/launch/test_memory_measured.py."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from shardtune.config import ConfigError
from shardtune.plan.strategy import read_accelerate_config
from tests.conftest import CONFIGS
from tests.launch.test_strategies import CONFIG_NAMES

DEEPSPEED_CONFIGS = [name for name in CONFIG_NAMES if name.startswith("ds_")]


def accelerate_launch_env(config: str, monkeypatch) -> dict:
    """What `accelerate launch --config_file <config>.yaml` exports for its DeepSpeed plugin (commands/launch.py
    `deepspeed_launcher`, utils/launch.py `prepare_deepspeed_cmd_env`), set here in-process."""
    import yaml

    launch = yaml.safe_load((CONFIGS / f"{config}.yaml").read_text())
    deepspeed = launch["deepspeed_config"]
    for name in [name for name in list(os.environ) if name.startswith(("ACCELERATE_", "DEEPSPEED_"))]:
        monkeypatch.delenv(name)
    fields = list(deepspeed) + (["mixed_precision"] if "mixed_precision" in launch else [])
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(fields))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", deepspeed["deepspeed_config_file"])
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", str(deepspeed["zero3_init_flag"]).lower())
    monkeypatch.chdir(CONFIGS.parent)  # the YAML names the JSON relative to the repository, as users launch
    return launch


@pytest.mark.parametrize("config", DEEPSPEED_CONFIGS)
def test_accelerate_reads_the_json_as_the_planner_and_the_checks_do(config, monkeypatch, tmp_path):
    """accelerate's own DeepSpeedPlugin, built from what `accelerate launch` exports for the shipped YAML, takes
    the stage, offload devices and 16-bit export from the JSON file; the planner, the start-up checks and the
    cross-rank fingerprint read the same values from the same file (no stage or offload variable is exported).
    bf16 is "auto": accelerate fills it from the run's precision."""
    from accelerate.utils import DeepSpeedPlugin

    from shardtune.checks.nvme import check_nvme_path
    from shardtune.config import Recipe
    from shardtune.launch import LaunchDescription
    from shardtune.parallel.ranks import deepspeed_fingerprint

    launch = accelerate_launch_env(config, monkeypatch)
    assert "mixed_precision" not in launch and "zero_stage" not in launch["deepspeed_config"]
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("bf16")
    planned = read_accelerate_config(str(CONFIGS / f"{config}.yaml"))
    launched = LaunchDescription.from_env()  # the start-up checks pass
    # The sequence split is the parallelism_config section's, not the JSON's
    # (tests/unit/parallel/test_sequence_split.py).
    assert launched.strategy("bf16") == dataclasses.replace(planned, name=f"DeepSpeed ZeRO-{planned.shard}",
                                                            sequence_split=1)
    assert (plugin.zero_stage, plugin.offload_optimizer_device, plugin.offload_param_device) == (
        planned.shard, planned.offload_optimizer, planned.offload_params)
    # ZeRO-3 gathers the 16-bit weights for the Hugging Face export (ZeRO-1/2 hold them whole anyway).
    assert plugin.zero3_init_flag == planned.ram_efficient_loading == plugin.zero3_save_16bit_model == (
        planned.shard == 3)
    assert plugin.deepspeed_config["bf16"]["enabled"] is True and planned.mixed_precision == "bf16"
    fingerprint = deepspeed_fingerprint(launched)
    assert fingerprint["deepspeed.stage"] == str(planned.shard)
    nvme = "nvme" in config
    if nvme:  # the flag fills the JSON's nvme_path "auto"; without it the run is refused
        with pytest.raises(ConfigError, match="pass --offload_nvme_path"):
            check_nvme_path(Recipe(), launched.nvme_offloaded)
        check_nvme_path(Recipe(offload_nvme_path=str(tmp_path)), launched.nvme_offloaded)
    else:
        check_nvme_path(Recipe(), launched.nvme_offloaded)
    # A mixed_precision in the YAML beside deepspeed_config_file is refused by accelerate itself.
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", os.environ["ACCELERATE_CONFIG_DS_FIELDS"] + ",mixed_precision")
    with pytest.raises(ValueError, match="deepspeed_config_file"):
        DeepSpeedPlugin()


def test_the_checks_read_a_bad_stage_or_offload_from_the_json(monkeypatch, tmp_path):
    from shardtune.launch import LaunchDescription

    accelerate_launch_env("ds_zero2", monkeypatch)
    for zero, message in (({"stage": 4}, "sets zero_stage '4'"),
                          ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param_device cpu needs ZeRO"),
                          ({"stage": 3, "offload_optimizer": {"device": "disk"}}, "offload_optimizer device 'disk'")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"zero_optimization": zero}))
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
        with pytest.raises(ConfigError, match=message):
            LaunchDescription.from_env()

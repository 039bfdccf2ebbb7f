"""Checkpoint files without a launch: the streamed safetensors writer gives safetensors' own file, and `auto`
skips a checkpoint that cannot resume. The crash, kill and SIGTERM tests are in
tests/launch/test_checkpoint_durable.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch


def test_streamed_safetensors_is_safetensors_own_file(tmp_path):
    """The background writer streams model.safetensors itself: byte for byte the file safetensors writes."""
    from safetensors.torch import save_file

    from shardtune.checkpoint.tensor_files import write_safetensors

    torch.manual_seed(0)
    state = {"w": torch.randn(4, 3), "bf16": torch.randn(3, 3).to(torch.bfloat16), "f64": torch.randn(2).double(),
             "ids": torch.arange(5), "mask": torch.ones(3, dtype=torch.bool), "empty": torch.zeros(0),
             "strided": torch.randn(4, 6)[:, ::2]}
    write_safetensors(state, str(tmp_path / "streamed.safetensors"))
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, tmp_path / "own.safetensors",
              metadata={"format": "pt"})
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "own.safetensors").read_bytes()


def test_auto_skips_what_cannot_resume(tmp_path, capsys):
    """`auto` walks back over damaged and model-only checkpoints, one warning line each, and starts fresh when
    none can resume; a marker written before markers listed files is trusted."""
    from shardtune.checkpoint.markers import describe_files, resolve_resume, write_marker

    def checkpoint(step: int, model_only: bool = False, listed: bool = True) -> Path:
        path = tmp_path / f"checkpoint-{step}"
        (path / "shards").mkdir(parents=True)
        (path / "shards" / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
        content = {"step": step, "world_size": 2, "model_only": model_only}
        write_marker(str(path), {**content, **({"files": describe_files(str(path))} if listed else {})})
        return path

    checkpoint(2, listed=False)
    checkpoint(4)
    checkpoint(6, model_only=True)
    (checkpoint(8) / "shards" / "__0_0.distcp").write_bytes(bytes(2048))  # same size, other bytes
    capsys.readouterr()
    assert resolve_resume("auto", str(tmp_path), 2) == (str(tmp_path / "checkpoint-4"), 4)
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and "checkpoint-8 is damaged: shards/__0_0.distcp differs from what was saved" in \
        warnings[0] and "checkpoint-6 was saved with --save_only_model true" in warnings[1], warnings
    (tmp_path / "checkpoint-4" / "shards" / "__0_0.distcp").unlink()
    assert resolve_resume("auto", str(tmp_path), 2) == (str(tmp_path / "checkpoint-2"), 2)
    os.truncate(tmp_path / "checkpoint-2" / "shards" / "__0_0.distcp", 0)
    assert resolve_resume("auto", str(tmp_path), 2) == (str(tmp_path / "checkpoint-2"), 2)  # nothing to check it by
    shutil.rmtree(tmp_path / "checkpoint-2")
    capsys.readouterr()
    assert resolve_resume("auto", str(tmp_path), 2) == (None, 0)
    assert "starting from step 0" in capsys.readouterr().err.splitlines()[-1]


def test_async_save_is_refused_beside_a_deepspeed_writer_of_its_own(tmp_path):
    """DeepSpeed's JSON may choose its own checkpoint engine (checkpoint.writer, datastates_ckpt): the background
    save writes with torch's, so the pair is refused before anything loads, not dropped after loading."""
    from shardtune.checks.outputs import check_async_save
    from shardtune.config import ConfigError, Recipe
    from shardtune.launch import LaunchDescription

    for settings in ({"checkpoint": {"writer": {"type": "fast"}}}, {"datastates_ckpt": {}}, {}):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 3}, **settings}))
        launch = LaunchDescription(world_size=2, uses_deepspeed=True, deepspeed_config_file=str(path))
        check_async_save(Recipe(async_save=False), launch)
        if settings:
            with pytest.raises(ConfigError, match="chooses a writer of its own"):
                check_async_save(Recipe(async_save=True), launch)
        else:
            check_async_save(Recipe(async_save=True), launch)

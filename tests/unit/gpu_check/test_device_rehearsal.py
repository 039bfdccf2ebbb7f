"""`make device-rehearsal` without building it: its virtualenv holds the device's versions and only what the device's
list names (the carried set comes from the target directory, as on the device), each case launches as gpu_check
launches it with the tiny sizes on CPU, and a GPU-only feature must end in the trainer's refusal of CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def rehearsal():
    return load_script("device_rehearsal")


def test_the_virtualenv_is_the_devices_versions_without_the_carried_set(rehearsal):
    wheels = rehearsal.gpu_wheels
    device = wheels.read_device_packages()
    requirements = rehearsal.device_requirements()
    names = {wheels.normalized(line.partition("==")[0]) for line in requirements}
    assert names <= set(device)
    assert {"torch==2.11.0", "transformers==5.17.0", "accelerate==1.15.0", "tokenizers==0.23.2"} <= set(requirements)
    carried = set(json.loads(wheels.SET_RECORD.read_text())["wheels"])
    assert not (names - {"transformers"}) & carried  # transformers: the device's 5.17, shadowed by the carried 5.24
    assert {"pyarrow", "pandas", "xxhash", "psutil"} <= names and "pydantic" not in names


def test_each_case_launches_as_gpu_check_does_with_the_tiny_sizes(rehearsal):
    gpu_check = rehearsal.gpu_check
    python = Path("/venv/bin/python")
    for case in gpu_check.CASES:
        command = rehearsal.rehearsal_command(case, python, "model", "data.jsonl", Path("out"))
        device = gpu_check.launch_command(case, "model", "data.jsonl", Path("out"))
        assert command[0] == str(python) and command[-2:] == ["--use_cpu", "true"]
        assert len(command) == len(device) + 2 and "flex_attention" not in command
        differing = {device[index]: command[index] for index in range(1, len(device)) if command[index] !=
                     device[index]}
        assert set(differing) <= {str(gpu_check.SEQ), str(gpu_check.MICRO), str(gpu_check.MICRO * case.accumulation),
                                  str(gpu_check.STEPS), "flex_attention"}, differing
        assert str(gpu_check.REPO / "scripts" / "device_counted_launch.py") in command


def test_a_gpu_only_feature_must_end_in_its_cpu_refusal(rehearsal):
    cases = {rehearsal.gpu_check.case_slug(case): case for case in rehearsal.gpu_check.CASES}
    fp8, plain = cases["fsdp_full_shard-padded-x4-fp8"], cases["fsdp_full_shard-padded-x4"]
    refusal = ("shardtune: error: --mixed_precision fp8 runs float8 matmuls on CUDA GPUs of compute capability 8.9 or "
               "more (H100, H200, L4, L40S): on this machine use --mixed_precision bf16.")
    assert rehearsal.outcome(fp8, 1, f"loading\n{refusal}\n") == "ok (refused on CPU as it must be)"
    assert rehearsal.outcome(fp8, 1, "ImportError: cannot import name 'x'").startswith("FAILED")
    assert rehearsal.outcome(fp8, 0, "trained").startswith("FAILED")  # trained on CPU: not what fp8 does
    assert rehearsal.outcome(plain, 0, "first loss 3.78") == "ok"
    assert rehearsal.outcome(plain, 1, "shardtune: error: boom\n=====\n") == "FAILED: exit 1: shardtune: error: boom"

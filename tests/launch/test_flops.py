"""`python -m shardtune.models.flops --json` as users run it: the FLOPs and MFU figures of the unit tests, printed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardtune.models.flops import flops_per_token, resolve_model
from tests.conftest import REPO


def test_cli_json():
    result = subprocess.run(
        [sys.executable, "-m", "shardtune.models.flops", "--model", "llama-3.1-70b", "--tokens_per_second", "400",
         "--gpus", "8", "--gpu", "h100", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["mfu"] == pytest.approx(0.02271, abs=5e-5)
    assert data["flops_per_token"] == flops_per_token(resolve_model("llama-3.1-70b"), 4096)
    assert data["tflops_per_gpu"] == pytest.approx(400 * data["flops_per_token"] / 8 / 1e12)



"""`make gpu-check` on a machine without CUDA: one line saying so and exit code 2, before anything is built.
(On a GPU it trains a 1.2B model in six configurations; that run is what its closing table reports.)"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ENV, REPO


def test_gpu_check_refuses_without_cuda():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py")], capture_output=True,
                            text=True, env=ENV, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check: error: no CUDA device is visible; run `make gpu-check` on a GPU machine."]

"""A launched recipe plans its memory on every rank before loading anything, and refuses a plan that does not
fit with the numbers and the nearest plan that does."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.conftest import ENV, REPO, run_recipe


def test_70b_zero3_on_one_h100_node_refused_before_loading(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--model_name_or_path", "meta-llama/Llama-3.1-70B",
                        "--hardware", "8xh100-80gb", config="ds_zero3", processes=2,
                        recipe=REPO / "recipes" / "llama70b.py", check=False)
    assert result.returncode != 0
    assert "with DeepSpeed ZeRO-3" in result.stdout and "DOES NOT FIT" in result.stdout
    error = next(line for line in result.stderr.splitlines() if line.startswith("shardtune: error:"))
    assert "does not fit 8xh100-80gb" in error and "141.1 GB of model states per GPU" in error
    assert "ds_zero3_cpu_offload" in error and "host RAM per node" in error
    assert "Loading weights" not in result.stderr and not output_dir.exists()


def test_dry_run_prints_the_plan_and_exits(tmp_path):
    def dry_run(recipe: str, hardware: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "recipes" / recipe), "--dry-run", "--hardware", hardware],
                              cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)

    fits = dry_run("llama1b.py", "8xh100-80gb")
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "llama-3.2-1b (1,235,814,400 params) on 8xh100-80gb" in fits.stdout and "-> fits" in fits.stdout
    too_big = dry_run("llama405b.py", "8xh100-80gb")
    assert too_big.returncode == 2 and "DOES NOT FIT" in too_big.stdout
    assert not list(tmp_path.iterdir())  # nothing written


def test_readme_plan_table_is_current():
    spec = importlib.util.spec_from_file_location("plan_table", REPO / "scripts" / "plan_table.py")
    plan_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_table)
    readme = (REPO / "README.md").read_text()
    assert plan_table.readme_with_table(readme) == readme, "run: python scripts/plan_table.py --write"
    assert "| llama-3.1-70b | 8xh100-80gb | ds_zero3_cpu_offload |" in readme

"""Two trainer defects only a GPU would show, tested where they are decided. --mixed_precision fp8 without
--torch_compile warns at start-up (torchao's casts unfused, pytorch/ao#685), and gpu-check's fp8 case compiles. A
LoRA model on a 16-bit base leaves bitsandbytes unimported, so TRL's activation offloader, which empties the CUDA
cache at every forward while "bitsandbytes" is in sys.modules, does not (the offloader itself needs a GPU to be
built: the condition it checks is tested here)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.config import Recipe
from shardtune.flags import parse_recipe
from shardtune.levers.float8 import unfused_fp8_warning
from tests.conftest import ENV, REPO, load_script


def test_fp8_without_compile_warns_in_one_line_and_gpu_checks_fp8_case_compiles():
    warning = unfused_fp8_warning(Recipe(mixed_precision="fp8"))
    assert warning is not None and "\n" not in warning
    assert "without --torch_compile true" in warning and "pytorch/ao#685" in warning
    assert warning.endswith("add --torch_compile true.")
    assert unfused_fp8_warning(Recipe(mixed_precision="fp8", torch_compile=True)) is None
    assert unfused_fp8_warning(Recipe(mixed_precision="bf16")) is None
    gpu_check = load_script("gpu_check")
    fp8_cases = [case for case in gpu_check.CASES if case[3].get("mixed_precision") == "fp8"]
    assert fp8_cases
    for *_, levers in fp8_cases:
        recipe = parse_recipe(Recipe(mixed_precision=levers["mixed_precision"]), gpu_check.lever_flags(levers))
        assert recipe.torch_compile and unfused_fp8_warning(recipe) is None


# Builds the LoRA model as a rank does (the start-up target check, then loading), imports TRL's offloader, and says
# whether bitsandbytes could be found and whether it is in sys.modules, the condition TRL's __enter__ checks.
BUILD = """
import importlib.util, json, sys
from transformers import AutoConfig
from shardtune.config import Recipe
from shardtune.model import load_model
from shardtune.checks.model import check_lora_targets
recipe = Recipe(model_name_or_path=sys.argv[1], use_peft=True, lora_r=4, lora_target_modules="q_proj,v_proj",
                mixed_precision="no", gradient_checkpointing=True, activation_offloading=True)
check_lora_targets(recipe, AutoConfig.from_pretrained(recipe.model_name_or_path))
model = load_model(recipe)
import trl.models.activation_offloading  # what shardtune.model.enable_activation_offloading imports
found = importlib.util.find_spec("bitsandbytes") is not None
print(json.dumps({"found": found, "imported": "bitsandbytes" in sys.modules,
                  "lora": sum(p.requires_grad for p in model.parameters())}))
"""


def bitsandbytes_path(tmp_path: Path) -> str:
    """Where `import bitsandbytes` finds one: the installed package, else a stand-in with the layer classes peft's
    LoRA dispatch looks for (bitsandbytes is not a requirement; it needs CUDA for anything real)."""
    if importlib.util.find_spec("bitsandbytes") is not None:
        return ""
    package = tmp_path / "stand-in" / "bitsandbytes"
    (package / "nn").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import nn\n")
    (package / "nn" / "__init__.py").write_text("class Linear4bit:\n    pass\n\n\nclass Linear8bitLt:\n    pass\n")
    return str(package.parent)


def run_python(code: str, path: str, *args: str) -> str:
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [path, str(REPO)]))}
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_a_lora_model_with_activation_offloading_leaves_bitsandbytes_unimported(tiny_assets, tmp_path):
    path = bitsandbytes_path(tmp_path)
    # peft imports it wherever it is installed: what the model building below must prevent
    assert run_python("import sys, peft; print('bitsandbytes' in sys.modules)", path) == "True"
    built = json.loads(run_python(BUILD, path, tiny_assets[0]))
    assert built["found"] and built["lora"] > 0
    assert not built["imported"], "TRL's offloader would empty the CUDA cache at every forward"


def test_bitsandbytes_is_kept_out_only_while_the_model_is_built():
    """No None left in sys.modules (TRL checks the name), and a 4-bit base (keep_out False) may import it."""
    from shardtune.model import bitsandbytes_kept_out

    with bitsandbytes_kept_out(True):
        assert importlib.util.find_spec("bitsandbytes") is None
        with pytest.raises(ImportError):
            import bitsandbytes  # noqa: F401
    assert "bitsandbytes" not in sys.modules
    with bitsandbytes_kept_out(False):
        assert "bitsandbytes" not in sys.modules

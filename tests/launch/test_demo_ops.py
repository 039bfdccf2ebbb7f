"""`make demo` builds the one DeepSpeed op its config loads (tests/unit/parallel/test_demo_ops.py): a launch of that
config compiles nothing more. The suite's ds_zero3 run (conftest.reference_run) starts with an extensions folder holding
that op alone; any op it loaded beyond it would have been compiled into the same folder."""

from __future__ import annotations

from tests.conftest import DEMO_CONFIG, DEMO_OPS, REPO


def test_the_demos_config_compiles_no_op_beyond_the_demos(reference_run):
    output_dir = reference_run(DEMO_CONFIG)
    extensions = output_dir.parent / "extensions"
    assert sorted(path.name for path in extensions.iterdir()) == sorted(DEMO_OPS)
    assert (output_dir / "model.safetensors").is_file()  # the run trained to its end with that op alone


def test_the_watched_config_is_the_makefiles_demo_config():
    assert f"DEMO_CONFIG := accelerate_configs/{DEMO_CONFIG}.yaml" in (REPO / "Makefile").read_text().splitlines()

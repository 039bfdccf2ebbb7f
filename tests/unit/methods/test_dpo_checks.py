"""--method dpo's bad flags and reference model: each refused in one line from the recipe's entry point, before
anything loads (tests/unit/checks/test_bad_input.py's harness), and every one of them reported together."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardtune.config import ConfigError, Recipe
from shardtune.levers.liger import check_liger_kernel
from shardtune.methods.checks import DPO_FIELDS, check_dpo_flags, check_dpo_launch, check_dpo_values
from tests.unit.checks.test_bad_input import Case, refused
from tests.unit.checks.test_checks_shared import dry_run_errors, no_launch  # noqa: F401 (autouse fixture)
from tests.unit.parallel.test_sequence_split import ULYSSES

DPO = ("--method", "dpo")
CASES = {
    "unknown method": Case(("--method", "ppo"), "--method must be one of sft, dpo; got 'ppo'."),
    "beta zero": Case((*DPO, "--beta", "0"), "--beta must be > 0, got 0.0"),
    "unknown loss type": Case((*DPO, "--loss_type", "sigmoid", "hingee"),
                              "--loss_type sigmoid hingee: hingee is not a DPO loss; choose among sigmoid, hinge"),
    "a loss named twice": Case((*DPO, "--loss_type", "sigmoid", "sigmoid"), "names a loss twice"),
    "weights of the wrong length": Case((*DPO, "--loss_type", "sigmoid", "sft", "--loss_weights", "1"),
                                        "--loss_weights has 1 value(s) for 2 --loss_type value(s)"),
    "robust smoothing out of range": Case((*DPO, "--loss_type", "robust", "--label_smoothing", "0.5"),
                                          "--label_smoothing 0.5 with the robust loss: it must lie in [0, 0.5)."),
    "exo_pair without smoothing": Case((*DPO, "--loss_type", "exo_pair"),
                                       "--label_smoothing 0.0 with the exo_pair loss: it must lie in (0, 1)"),
    "smoothing out of range": Case((*DPO, "--label_smoothing", "1"), "--label_smoothing must lie in [0, 1), got 1"),
    "beta without DPO": Case(("--beta", "0.1"), "--beta configures DPO, which runs only with --method dpo: add "
                                                "it, or drop it."),
    "DPO flags without DPO": Case(("--precompute_ref_log_probs", "false", "--ref_model_name_or_path", "{tmp}/m"),
                                  "--precompute_ref_log_probs, --ref_model_name_or_path configure DPO"),
    "packing": Case((*DPO, "--packing", "true"), "--packing with --method dpo"),
    "rows dropped by length": Case((*DPO, "--truncation", "drop"), "--truncation drop with --method dpo"),
    "loss on the prompt": Case((*DPO, "--completion_only_loss", "false"), "--completion_only_loss false with "
                                                                          "--method dpo"),
    "an adapter on the head": Case((*DPO, "--use_peft", "true", "--lora_target_modules", "q_proj,lm_head"),
                                   "--lora_target_modules lm_head with --method dpo: DPO's log-probs multiply by the "
                                   "LM head's weight itself"),
    "missing reference": Case((*DPO, "--ref_model_name_or_path", "{tmp}/models/ref"),
                              "Model directory not found: '"),
    "reference without weights": Case((*DPO, "--ref_model_name_or_path", "{tmp}/ref"),
                                      "--ref_model_name_or_path '", files={"ref/config.json": "{}"}),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_in_one_line(case, tiny_assets, tmp_path, capsys, monkeypatch):
    spec = CASES[case]
    error_lines, stderr = refused(spec, tiny_assets, tmp_path, capsys, monkeypatch)
    assert len(error_lines) == 1 and spec.message in error_lines[0], stderr[-2000:]
    if "ref_model_name_or_path" in " ".join(spec.args) and spec.args[:2] == DPO:
        assert "--ref_model_name_or_path" in error_lines[0] and "--model_name_or_path" not in \
            error_lines[0].replace("--ref_model_name_or_path", ""), error_lines


def test_every_dpo_problem_is_reported_at_once(tiny_assets, tmp_path, capsys, monkeypatch):
    spec = Case((*DPO, "--beta", "-1", "--loss_type", "robust", "--label_smoothing", "0.7", "--packing", "true"), "")
    error_lines, stderr = refused(spec, tiny_assets, tmp_path, capsys, monkeypatch)
    assert [line.split(":")[2].split(",")[0].strip() for line in error_lines] == [
        "--beta must be > 0", "--label_smoothing 0.7 with the robust loss", "--packing with --method dpo"], stderr


def test_a_flag_at_its_default_counts_as_given_and_dpo_takes_its_own():
    """--beta 0.1 (its default) on an SFT command line is refused; a recipe that sets DPO's fields for another
    method is refused too; under DPO every one of them is taken."""
    with pytest.raises(ConfigError, match="--beta configures DPO"):
        check_dpo_flags(Recipe(), frozenset({"beta"}))
    with pytest.raises(ConfigError, match="--loss_type configures DPO"):
        check_dpo_flags(Recipe(loss_type=["ipo"]))
    check_dpo_flags(Recipe())
    check_dpo_flags(Recipe(method="dpo"), frozenset(DPO_FIELDS))
    check_dpo_values(Recipe(method="dpo", loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]))
    check_dpo_values(Recipe(method="dpo", loss_type=["exo_pair"], label_smoothing=1e-3))
    check_dpo_values(Recipe(beta=-1.0))  # without --method dpo: check_dpo_flags' to refuse


def test_liger_takes_the_full_logits_under_dpo():
    """--use_liger_kernel with --chunked_cross_entropy false is refused for SFT (Liger's fused loss replaces the
    tiles), and taken under DPO: its layers apply, and its log-probs take no loss of Liger's."""
    with pytest.raises(ConfigError, match="--chunked_cross_entropy false asks for the full logits"):
        check_liger_kernel(Recipe(use_liger_kernel=True, chunked_cross_entropy=False))
    check_liger_kernel(Recipe(method="dpo", use_liger_kernel=True, chunked_cross_entropy=False))


def test_the_sequence_split_is_refused_for_dpo(capsys):
    """Planned or launched alike (checks.check_on_device), under the Ulysses config's sp_size 8."""
    errors = dry_run_errors(capsys, ULYSSES, *DPO)
    assert [line for line in errors if "--method dpo under the sequence split (sp_size 8" in line], errors
    check_dpo_launch(Recipe(method="dpo"), 1)
    check_dpo_launch(Recipe(), 8)


def reference_copy(tiny_assets, tmp_path: Path) -> Path:
    reference = tmp_path / "reference"
    shutil.copytree(tiny_assets[0], reference)
    return reference


def test_the_reference_must_share_the_policys_vocabulary(tiny_assets, tmp_path, capsys, monkeypatch):
    """A reference of another vocabulary size, or of the same size with other tokens, would score the policy's
    token ids as other tokens: refused in one line. The policy's own copy is taken."""
    from transformers import LlamaForCausalLM

    from shardtune.models.tiny_assets import tiny_llama_config

    larger = tmp_path / "larger"
    config = json.loads((Path(tiny_assets[0]) / "config.json").read_text())
    LlamaForCausalLM(tiny_llama_config(config["vocab_size"] + 8)).save_pretrained(larger)
    spec = Case((*DPO, "--ref_model_name_or_path", str(larger)), "")
    error_lines, stderr = refused(spec, tiny_assets, tmp_path, capsys, monkeypatch)
    assert len(error_lines) == 1 and f"has a vocabulary of {config['vocab_size'] + 8} tokens and the policy " \
        f"{config['vocab_size']}" in error_lines[0], stderr[-2000:]

    swapped = reference_copy(tiny_assets, tmp_path)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    spec = Case((*DPO, "--ref_model_name_or_path", str(swapped)), "")
    error_lines, stderr = refused(spec, tiny_assets, tmp_path, capsys, monkeypatch)
    assert len(error_lines) == 1 and "has another tokenizer than the policy" in error_lines[0], stderr[-2000:]

    from shardtune.methods.checks import check_reference_model

    same = reference_copy(tiny_assets, tmp_path / "same")
    check_reference_model(Recipe(method="dpo", model_name_or_path=tiny_assets[0], ref_model_name_or_path=str(same)))


def test_a_dry_run_plans_the_reference_in_its_own_shape(capsys, tmp_path):
    """A recipe's --dry_run plans --ref_model_name_or_path from its config.json (here a built-in shape, 8B beside
    the 1B policy), and one it cannot read is refused in one line naming that flag, not a traceback."""
    from shardtune.cli import main
    from tests.conftest import CONFIGS
    from tests.unit.checks.test_checks_shared import PLANNED

    config = str(CONFIGS / "ds_zero3.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(PLANNED, ["--dry_run", "--hardware", "8xh100-80gb", "--config_file", config, *DPO,
                       "--ref_model_name_or_path", "llama-3.1-8b"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "a frozen bf16 copy of llama-3.1-8b (8.03B params), sharded as the policy" \
        in out, out[-2000:]
    errors = dry_run_errors(capsys, config, *DPO, "--ref_model_name_or_path", str(tmp_path / "missing"))
    assert len(errors) == 1 and errors[0].startswith(
        f"shardtune: error: Model directory not found: '{tmp_path}/missing'. Check the path given to "
        "--ref_model_name_or_path."), errors

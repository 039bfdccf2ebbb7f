"""A peer in the suite: the tiny recipe with --method dpo (one process, fp32) and TRL's DPOTrainer train the same
preference pairs with the same optimizer, schedule and batches. Their token ids per sequence, and each step's loss,
gradient norm, learning rate and reward metrics must agree, for the sigmoid loss on text pairs (one chosen answer
already ending in the EOS text, several sequences cut by the length), IPO on chat pairs with the prompt implied (the
shared leading turns), RPO (sigmoid + 0.5 x sft) with the reference's log-probs precomputed by shardtune while
TRL runs its live reference, and every other loss TRL has that shardtune takes (hinge, robust, exo_pair, ...) at
once, each with its own weight.

TRL runs in a process of its own (tests/launch/trl_dpo_peer.py): trl is a test dependency, imported neither by the
package nor by this test process. Where the conventions could differ, and why they agree here:
- Tokens: both tokenize prompt and prompt + completion whole and start the completion where they diverge; text
  completions get the EOS text unless they end with it; both cut each sequence to max_length, keeping its start.
- Loss: TRL averages each micro-batch's per-pair losses and the Trainer averages micro-batches; shardtune sums the
  global batch's pair losses and divides by its pair count: the same when every micro-batch holds as many pairs.
- Log-probs: TRL's fused LM head scores the target positions in tiles, shardtune's tiles score every position and
  keep the targets': fp32 sums in another order.
Row order: neither shuffles the rows while preparing them, and both loaders are accelerate's seedable sampler with
the same data seed; the 4 steps span 2 epochs.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.config import DPO_LOSS_TYPES, Recipe
from shardtune.data.loading import load_splits
from shardtune.methods.dpo_loss import PAIR_METRICS
from shardtune.model import load_tokenizer
from shardtune.models.tiny_assets import preference_examples
from tests.conftest import launch_env, popen, read_metrics, start_recipe
from tests.unit.data.test_formats import write_jsonl

TRL_PEER = Path(__file__).with_name("trl_dpo_peer.py")
ROWS = 16
MAX_LENGTH = 18  # text pairs: the longest prompts and answers are cut; every pair still differs within it
CHAT_MAX_LENGTH = 48  # chat pairs: 2 of the longest conversations are cut within their answers
SHARED = {"learning_rate": 1e-3, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-8, "weight_decay": 0.1,
          "max_grad_norm": 1.0, "lr_scheduler_type": "cosine", "warmup_steps": 1, "max_steps": 4, "seed": 42,
          "per_device_train_batch_size": 4}
ACCUMULATION = 2  # 16 pairs: 2 steps of 2 micro-batches of 4 per epoch
SHARDTUNE_ARGS = ("--method", "dpo", "--global_batch_size", str(4 * ACCUMULATION),
                  "--mixed_precision", "no", "--gradient_checkpointing", "false", "--save_steps", "0",
                  "--save_model", "false", "--generation_samples", "0",
                  *(item for name, value in SHARED.items() for item in (f"--{name}", str(value))))
TRL_ARGS = {**SHARED, "gradient_accumulation_steps": ACCUMULATION, "data_seed": SHARED["seed"],
            "use_cpu": True, "bf16": False, "fp16": False, "gradient_checkpointing": False,
            "optim": "adamw_torch", "logging_steps": 1, "report_to": "none", "save_strategy": "no",
            "disable_tqdm": True}
RTOL = 1e-5  # fp32 sums in another order: about 1e-7 relative measured
REWARD_ATOL = 1e-6  # rewards start at 0 (policy = reference)


def text_pairs() -> list[dict]:
    """The tiny task's pairs; one chosen answer ends with the EOS text already."""
    rows = preference_examples(ROWS, seed=5)
    rows[3]["chosen"] += "</s>"
    return rows


def chat_pairs() -> list[dict]:
    """UltraFeedback's form: chosen and rejected conversations sharing their system and user turns."""
    rng, rows = random.Random(5), []
    for row in preference_examples(ROWS, seed=7):
        system = {"role": "system", "content": rng.choice(["be brief", "reverse"])}
        user = {"role": "user", "content": row["prompt"]}
        rows.append({side: [system, user, {"role": "assistant", "content": row[side]}]
                     for side in ("chosen", "rejected")})
    return rows


EVERY_LOSS = tuple(name for name in DPO_LOSS_TYPES if name not in ("sigmoid", "ipo", "sft"))
WEIGHTS = [round(0.3 + 0.1 * index, 1) for index in range(len(EVERY_LOSS))]
CASES = {  # rows, max length, shardtune's flags, TRL's
    "text-sigmoid": (text_pairs, MAX_LENGTH, (), {}),
    "chat-ipo": (chat_pairs, CHAT_MAX_LENGTH, ("--loss_type", "ipo", "--beta", "0.5"),
                 {"loss_type": ["ipo"], "beta": 0.5}),
    "text-rpo-precomputed": (text_pairs, MAX_LENGTH, ("--loss_type", "sigmoid", "sft", "--loss_weights", "1", "0.5",
                                                      "--precompute_ref_log_probs", "true"),
                             {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
    # every other pairwise loss at once, each weighted differently, so that a wrong term moves the sum
    "text-every-loss": (text_pairs, MAX_LENGTH, ("--loss_type", *EVERY_LOSS, "--loss_weights", *map(str, WEIGHTS),
                                                 "--label_smoothing", "0.1"),
                        {"loss_type": list(EVERY_LOSS), "loss_weights": WEIGHTS, "label_smoothing": 0.1}),
}


def start_trl(root: Path, model_dir: str, data_file: str, extra: dict) -> subprocess.Popen:
    settings = {"model_dir": model_dir, "data_file": data_file, "output_dir": str(root / "trl"),
                "args": {**TRL_ARGS, **extra}}
    (root / "trl.json").write_text(json.dumps(settings))
    log = open(root / "trl.log", "w")  # noqa: SIM115 (closed with the process)
    return popen([sys.executable, str(TRL_PEER), str(root / "trl.json"), str(root / "trl-out.json")], cwd=root,
                 env=launch_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.parametrize("case", CASES)
def test_dpo_trainer_and_shardtune_agree(case, tmp_path, tiny_assets):
    make_rows, max_length, our_args, trl_extra = CASES[case]
    data_file = write_jsonl(tmp_path / "pairs.jsonl", make_rows())
    model_dir = tiny_assets[0]
    runs = {"trl": start_trl(tmp_path, model_dir, data_file, {**trl_extra, "max_length": max_length}),  # side by side
            "shardtune": start_recipe(tmp_path / "shardtune", tiny_assets, "--dataset", data_file,
                                      "--eval_split", data_file, "--max_seq_length", str(max_length),
                                      *SHARDTUNE_ARGS, *our_args)}
    recipe = Recipe(model_name_or_path=model_dir, dataset=data_file, eval_split=data_file, method="dpo",
                    max_seq_length=max_length)
    ours = load_splits(recipe, load_tokenizer(recipe))[0]
    assert "trl" not in sys.modules  # shardtune's data path does not pull in trl
    for name, process in runs.items():
        assert process.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    peer = json.loads((tmp_path / "trl-out.json").read_text())

    # Token ids of each pair's prompt and answers, in the same order; some are cut by the length.
    assert len(ours) == len(peer["rows"]) == ROWS
    for index, (mine, theirs) in enumerate(zip(ours, peer["rows"], strict=True)):
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert mine[key] == theirs[key], f"pair {index}: {key} differ"
    assert sum(len(row["prompt_ids"]) + len(row["chosen_ids"]) > max_length for row in ours) >= 2
    if case.startswith("text"):  # exactly one EOS per answer, whether its text ended with one or not
        assert all(row["chosen_ids"].count(2) == 1 and row["chosen_ids"][-1] == 2 for row in ours)

    # Each step's loss, gradient norm (before clipping), learning rate and reward metrics.
    steps = [row for row in read_metrics(tmp_path / "shardtune") if "loss" in row]
    logged = [row for row in peer["log_history"] if "loss" in row]
    assert [row["step"] for row in steps] == [row["step"] for row in logged] == [1, 2, 3, 4]
    assert [row["lr"] for row in steps] == [row["learning_rate"] for row in logged]
    deviations = {name: max(abs(mine[name] - theirs[name]) / max(abs(theirs[name]), REWARD_ATOL)
                            for mine, theirs in zip(steps, logged, strict=True))
                  for name in ("loss", "grad_norm", *PAIR_METRICS)}
    print(f"{case}: largest relative deviation from TRL over 4 steps: "
          + ", ".join(f"{name} {value:.1e}" for name, value in deviations.items()))
    for mine, theirs in zip(steps, logged, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=RTOL), (mine, theirs)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=RTOL), (mine, theirs)
        for name in PAIR_METRICS:
            assert mine[name] == pytest.approx(theirs[name], rel=RTOL, abs=REWARD_ATOL), (name, mine, theirs)
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < steps[0]["loss"]  # the steps trained
    log = (tmp_path / "shardtune.log").read_text()
    assert ("reference log-probs of 16 train pairs computed" in log) == ("precomputed" in case), log[-2000:]

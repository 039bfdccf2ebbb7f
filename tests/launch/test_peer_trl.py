"""A peer in the suite: the tiny recipe (one process, fp32) and TRL's SFTTrainer train the same rows with the same
optimizer, schedule and batches, on prompt/completion rows and on multi-turn chats with a system message. Their
token ids, the tokens that carry loss, and each step's loss, gradient norm and learning rate must agree.

TRL runs in a process of its own (tests/launch/trl_peer.py): trl is a test dependency, imported neither by the
package nor by this test process.

Where the conventions differ, and why they still agree here:
- Prompt/completion boundary: shardtune tokenizes the prompt (with BOS) and the completion apart and joins the ids;
  TRL tokenizes the prompt and the joined text and starts the completion where the two diverge. With a subword
  tokenizer a merge across the boundary can make the ids differ; the tiny tokenizer has one token per character,
  so nothing merges and the ids must be equal.
- End of sequence: shardtune appends the EOS id unless the completion's last token is EOS; TRL appends the EOS text
  unless the completion's text ends with it. One row ends with the EOS text: both must give it exactly one EOS.
- Assistant turns: TRL trains what the chat template marks with `{% generation %}` (assistant_only_loss); shardtune
  trains what the template adds between the prompt rendered with the generation prompt and the prompt including
  the turn. TRL gets the tiny template with markers around each reply and its EOS, which renders the same text.
- Loss: shardtune runs the model's cross-entropy over the logits, TRL its fused LM head (log-probabilities in
  tiles, target positions only); both sum over the target tokens and divide by the target count of the whole
  step's batch (`num_items_in_batch`, counted on labels[..., 1:]). The sums run in another order: fp32 rounding.
- Learning rate: shardtune logs the rate a step used (read before the scheduler steps); transformers 5.24's
  Trainer logs the rate read after `optimizer.step()` and before `lr_scheduler.step()`, the same rate. Both come
  from transformers' `get_scheduler` with the same arguments: equal to the last bit.
Row order: neither shuffles the rows while preparing them, and both loaders are accelerate's seedable sampler with
the same data seed (shardtune: --seed; TRL: data_seed), re-seeded per epoch; the 4 steps span 2 epochs.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardtune.config import Recipe
from shardtune.data.loading import load_splits
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.model import load_tokenizer
from shardtune.models.tiny_assets import TASK_LETTERS, reversal_examples
from tests.conftest import launch_env, popen, read_metrics, start_recipe
from tests.unit.data.test_formats import write_jsonl

TRL_PEER = Path(__file__).with_name("trl_peer.py")
ROWS = 16
MAX_LENGTH = 128  # every row fits: nothing is truncated
# The settings both take under the same names (shardtune's flags follow TrainingArguments').
SHARED = {"learning_rate": 1e-3, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-8, "weight_decay": 0.1,
          "max_grad_norm": 1.0, "lr_scheduler_type": "cosine", "warmup_steps": 1, "max_steps": 4, "seed": 42,
          "per_device_train_batch_size": 4}
ACCUMULATION = 2  # 16 rows: 2 steps of 2 micro-batches of 4 per epoch
SHARDTUNE_ARGS = ("--max_seq_length", str(MAX_LENGTH), "--global_batch_size", str(4 * ACCUMULATION),
                  "--mixed_precision", "no", "--gradient_checkpointing", "false", "--save_steps", "0",
                  "--save_model", "false",
                  *(item for name, value in SHARED.items() for item in (f"--{name}", str(value))))
TRL_ARGS = {**SHARED, "gradient_accumulation_steps": ACCUMULATION, "data_seed": SHARED["seed"],
            "max_length": MAX_LENGTH, "use_cpu": True, "bf16": False, "fp16": False,
            "activation_checkpointing": False, "optim": "adamw_torch",  # torch.optim.AdamW, unfused, as shardtune's
            "logging_steps": 1, "report_to": "none", "save_strategy": "no", "disable_tqdm": True}
# The tiny chat template (models.tiny_assets.CHAT_TEMPLATE) with TRL's assistant markers around each reply and its EOS.
MARKED_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ 'assistant:' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['role'] + ':' + message['content'] + '>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
LOSS_RTOL = 1e-6  # fp32 sums in another order (and TRL's tiled log-softmax): about 1e-7 relative measured


def prompt_completion_rows() -> tuple[list[dict], list[int]]:
    """Reversal rows, one whose completion already ends with the EOS text; each row's target count: its
    completion's characters and one EOS."""
    rows = reversal_examples(ROWS, seed=3)
    rows[5]["completion"] += "</s>"
    return rows, [len(row["completion"].removesuffix("</s>")) + 1 for row in rows]


def chat_rows() -> tuple[list[dict], list[int]]:
    """A system message, then three exchanges (reverse, copy, count a word); the target count: each reply's
    characters and its EOS."""
    rng, rows, counts = random.Random(3), [], []
    for _ in range(ROWS):
        word = "".join(rng.choice(TASK_LETTERS) for _ in range(rng.randint(3, 5)))
        replies = [word[::-1], word, str(len(word))]
        messages = [{"role": "system", "content": "be brief"}]
        for task, reply in zip(("rev", "cpy", "len"), replies, strict=True):
            messages += [{"role": "user", "content": f"{task} {word}="}, {"role": "assistant", "content": reply}]
        rows.append({"messages": messages})
        counts.append(sum(len(reply) + 1 for reply in replies))
    return rows, counts


FORMATS = {"prompt_completion": (prompt_completion_rows, None, {}),
           "messages": (chat_rows, MARKED_TEMPLATE, {"assistant_only_loss": True})}


def shardtune_rows(model_dir: str, data_file: str) -> list[dict]:
    """The training rows as shardtune's data pipeline makes them for the run (the data file is the eval split
    too, so no rows are held out and the order is the file's)."""
    recipe = Recipe(model_name_or_path=model_dir, dataset=data_file, eval_split=data_file, max_seq_length=MAX_LENGTH)
    train, _ = load_splits(recipe, load_tokenizer(recipe))
    return [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in train]


@contextlib.contextmanager
def imports_refused(package: str) -> Iterator[None]:
    """Inside, importing `package` raises, whether or not this process imported it before (another test file run
    in the same pytest worker may have)."""
    held = {name: module for name, module in sys.modules.items() if name == package or name.startswith(f"{package}.")}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == package or name.startswith(f"{package}."):
                raise ImportError(f"{name} imported where it must not be")

    finder = Refuse()
    for name in held:
        del sys.modules[name]
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        sys.modules.update(held)


def start_trl(root: Path, model_dir: str, data_file: str, chat_template: str | None, extra: dict
              ) -> subprocess.Popen:
    settings = {"model_dir": model_dir, "data_file": data_file, "output_dir": str(root / "trl"),
                "chat_template": chat_template, "args": {**TRL_ARGS, **extra}}
    (root / "trl.json").write_text(json.dumps(settings))
    log = open(root / "trl.log", "w")  # noqa: SIM115 (closed with the process)
    return popen([sys.executable, str(TRL_PEER), str(root / "trl.json"), str(root / "trl-out.json")], cwd=root,
                 env=launch_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def target_positions(labels: list[int]) -> list[int]:
    return [index for index, label in enumerate(labels) if label != IGNORE_INDEX]


@pytest.mark.parametrize("data_format", FORMATS)
def test_sft_trainer_and_shardtune_agree(data_format, tmp_path, tiny_assets):
    """Both trainers side by side (one core each); shardtune's rows come from its own data pipeline, TRL's from
    SFTTrainer's prepared train_dataset."""
    make_rows, chat_template, trl_extra = FORMATS[data_format]
    rows, target_counts = make_rows()
    data_file = write_jsonl(tmp_path / f"{data_format}.jsonl", rows)
    model_dir = tiny_assets[0]
    runs = {"trl": start_trl(tmp_path, model_dir, data_file, chat_template, trl_extra),  # side by side
            "shardtune": start_recipe(tmp_path / "shardtune", tiny_assets, "--dataset", data_file,
                                      "--eval_split", data_file, *SHARDTUNE_ARGS)}
    with imports_refused("trl"):  # shardtune's data path does not pull in trl
        ours = shardtune_rows(model_dir, data_file)
    for name, process in runs.items():
        assert process.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    peer = json.loads((tmp_path / "trl-out.json").read_text())

    # Tokens and masks, row by row, in the same order.
    assert len(ours) == len(peer["rows"]) == ROWS
    for index, (mine, theirs, count) in enumerate(zip(ours, peer["rows"], target_counts, strict=True)):
        assert mine["input_ids"] == theirs["input_ids"], f"row {index}: token ids differ"
        assert target_positions(mine["labels"]) == target_positions(theirs["labels"]), f"row {index}: masks differ"
        assert mine["labels"] == theirs["labels"], f"row {index}: labels differ"
        assert len(target_positions(mine["labels"])) == count, f"row {index}: not one EOS per reply"

    # Each step's loss, gradient norm (before clipping) and learning rate.
    steps = [row for row in read_metrics(tmp_path / "shardtune") if "loss" in row]
    logged = [row for row in peer["log_history"] if "loss" in row]
    assert [row["step"] for row in steps] == [row["step"] for row in logged] == [1, 2, 3, 4]
    assert [row["lr"] for row in steps] == [row["learning_rate"] for row in logged]
    assert steps[0]["lr"] == 0 and len({row["lr"] for row in steps}) == 4  # warm-up, then the cosine decay
    for mine, theirs in zip(steps, logged, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=LOSS_RTOL), (mine, theirs)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=LOSS_RTOL), (mine, theirs)
    assert steps[-1]["loss"] < steps[0]["loss"]  # the steps trained

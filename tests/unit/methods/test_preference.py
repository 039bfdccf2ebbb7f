"""Preference pairs as TRL 1.16's DPOTrainer makes them, with the tiny tokenizer (one token per character, so any
difference is a real one): the same prompt, chosen and rejected ids (text pairs with one EOS, chat pairs through
the template, the implied prompt), the same batches cut keeping the start, and the pairs that teach nothing dropped
and counted. The bad rows each refused in one line naming the row and the fix, and pairs tokenized ahead by
scripts/prepare_data.py read back as they are.

TRL runs in a process of its own (as tests/launch/trl_peer.py): trl stays out of the test process."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from shardtune.config import ConfigError, Recipe
from shardtune.data.loading import load_splits
from shardtune.data.tokenize import IGNORE_INDEX, tokenize
from shardtune.methods.pair_batches import PreferenceCollator
from shardtune.methods.preference import PAIR_COLUMNS
from tests.conftest import launch_env, load_script

MAX_LENGTH = 48  # cuts the longer pairs (keep_start) and drops the one whose prompt fills it
SYSTEM = {"role": "system", "content": "be brief"}
LONG = "abcdefghij" * 3


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


SOURCES = {
    "text": [
        {"prompt": "rev abc=", "chosen": "cba", "rejected": "abc"},
        {"prompt": "rev " + LONG + "=", "chosen": LONG[::-1], "rejected": LONG[1:] + LONG[0]},  # cut to MAX_LENGTH
        {"prompt": "rev ab=", "chosen": "ba</s>", "rejected": "ab"},  # ends with the EOS text: keeps it, once
        {"prompt": "rev " + LONG * 2 + "=", "chosen": "a", "rejected": "b"},  # the prompt fills the length
    ],
    "implied chat prompt": [
        {"chosen": [SYSTEM, user("rev abc="), assistant("cba")], "rejected": [SYSTEM, user("rev abc="),
                                                                             assistant("bca")]},
        {"chosen": [user("r ab="), assistant("ba"), user("c cd="), assistant("cd")],  # cut to MAX_LENGTH
         "rejected": [user("r ab="), assistant("ba"), user("c cd="), assistant("dc")]},
    ],
    "chat with prompt": [
        {"prompt": [SYSTEM, user("rev abc=")], "chosen": [assistant("cba")], "rejected": [assistant("bca")]},
        {"prompt": [user("r ab="), assistant("ba"), user("c cd=")], "chosen": [assistant("cd")],
         "rejected": [assistant("dc")]},
    ],
}

PEER = """
import json, sys, types
from datasets import Dataset
from transformers import AutoTokenizer
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

settings = json.loads(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(settings["model_dir"])
args = types.SimpleNamespace(dataset_num_proc=None, max_length=settings["max_length"], truncation_mode="keep_start")
collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=settings["max_length"])
out = {}
for name, rows in settings["sources"].items():
    trainer = types.SimpleNamespace(_tokenizer=tokenizer)  # all of the trainer that _prepare_dataset reads
    prepared = DPOTrainer._prepare_dataset(trainer, Dataset.from_list(rows), tokenizer, args, name)
    pairs = [{key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in prepared]
    out[name] = {"pairs": pairs, "batch": {key: value.tolist() for key, value in collate(pairs).items()}}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def trl_pairs(tiny_assets) -> dict:
    """TRL's tokenized pairs and collated batch of each of SOURCES."""
    settings = {"model_dir": tiny_assets[0], "max_length": MAX_LENGTH, "sources": SOURCES}
    # the launches' scrubbed environment: a rank's variables another test left in this process would make TRL's
    # accelerate state start a process group
    result = subprocess.run([sys.executable, "-c", PEER, json.dumps(settings)], capture_output=True, text=True,
                            timeout=300, env=launch_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets[0])


def dpo_recipe(dataset: str = "pairs", **fields) -> Recipe:
    return Recipe(**{"method": "dpo", "model_name_or_path": "tiny", "dataset": dataset, "max_seq_length": MAX_LENGTH,
                     **fields})


def our_pairs(rows: list[dict], tokenizer) -> list[dict]:
    return tokenize(Dataset.from_list(rows), dpo_recipe(), tokenizer, "train", "pairs").to_list()


@pytest.mark.parametrize("source", SOURCES)
def test_pairs_and_batches_are_trls(source, trl_pairs, tokenizer):
    """The same ids for each pair TRL keeps (it drops the pair whose prompt fills the length, as we do), and the
    same batch: chosen rows then rejected rows, right-padded, each cut to the length keeping its start; our labels
    are TRL's completion mask."""
    theirs = trl_pairs[source]
    ours = our_pairs(SOURCES[source], tokenizer)
    assert ours == theirs["pairs"]
    batch = PreferenceCollator(tokenizer.pad_token_id, MAX_LENGTH)(ours)
    assert batch["input_ids"].tolist() == theirs["batch"]["input_ids"]
    assert batch["attention_mask"].tolist() == theirs["batch"]["attention_mask"]
    assert (batch["labels"] != IGNORE_INDEX).long().tolist() == theirs["batch"]["completion_mask"]
    labelled = batch["labels"] != IGNORE_INDEX
    assert (batch["labels"][labelled] == batch["input_ids"][labelled]).all()


def test_text_answers_end_in_exactly_one_eos(tokenizer):
    eos = tokenizer.eos_token_id
    for pair in our_pairs(SOURCES["text"][:3], tokenizer):
        for side in ("chosen_ids", "rejected_ids"):
            assert pair[side][-1] == eos and pair[side].count(eos) == 1, pair


def test_the_implied_prompt_is_the_shared_leading_turns(tokenizer):
    """A chat pair without `prompt` tokenizes as the same pair with its shared leading turns given as the
    prompt, and its prompt ends with the template's generation prompt."""
    implied, given = (our_pairs(SOURCES[name], tokenizer) for name in ("implied chat prompt", "chat with prompt"))
    assert implied == given
    generation = tokenizer.encode("assistant:", add_special_tokens=False)
    assert all(pair["prompt_ids"][-len(generation):] == generation for pair in implied)


def test_pairs_that_teach_nothing_are_dropped_and_counted(tokenizer, caplog):
    """A pair whose prompt fills the length, and one whose chosen and rejected sequences are the same once cut,
    are dropped, each counted in the start-up line; a pair that differs only after the cut teaches nothing."""
    rows = [{"prompt": "rev abc=", "chosen": "cba", "rejected": "abc"},
            {"prompt": "rev " + LONG * 2 + "=", "chosen": "a", "rejected": "b"},
            {"prompt": "rev abcdefgh=", "chosen": LONG * 2, "rejected": LONG * 2 + "b"}]
    with caplog.at_level(logging.WARNING, logger="shardtune.methods.preference"):
        kept = our_pairs(rows, tokenizer)
    assert len(kept) == 1 and kept[0]["chosen_ids"] == tokenizer.encode("cba</s>", add_special_tokens=False)
    line = next(record.getMessage() for record in caplog.records if "pairs of pairs" in record.getMessage())
    assert f"1 pairs, text; 2 with a sequence longer than {MAX_LENGTH} tokens (truncated), 1 whose prompt fills " \
           "the length and 1 whose chosen and rejected are the same once truncated (dropped)" in line, line
    with pytest.raises(ConfigError, match=f"No train pair of 'pairs' is left once cut to --max_seq_length {MAX_LENGTH}:"
                       ):
        our_pairs(rows[1:], tokenizer)


# --- refusals ---------------------------------------------------------------------------------------------------

GOOD = [{"prompt": f"rev ab{index}=", "chosen": f"{index}ba", "rejected": f"ab{index}"} for index in range(4)]
CHAT = {"chosen": [user("q"), assistant("x")], "rejected": [user("q"), assistant("y")]}
BAD_ROWS = {
    "a misspelt column": ([{"prompt": "a", "chosen": "b", "rejectd": "c"}] * 3, "sft",
                          "match no known format (`rejectd`: did you mean `rejected`?)"),
    "SFT rows in a DPO run": ([{"prompt": "a", "completion": "b"}] * 3, "dpo",
                              "holds prompt_completion rows, which --method dpo does not train: give it preference "
                              "pairs (`chosen` and `rejected`, with or without `prompt`), or drop --method dpo."),
    "pairs in an SFT run": (GOOD, "sft", "holds preference rows, which --method sft does not train: add --method "
                                         "dpo"),
    "the same answers": ([*GOOD, {"prompt": "p", "chosen": "x", "rejected": "x"}], "dpo",
                         "Dataset row 4: `chosen` and `rejected` are the same: a pair needs two different answers; "
                         "delete the row (in '{path}')."),
    "text and chat in a row": ([*GOOD, {"prompt": "p", "chosen": [assistant("x")], "rejected": [assistant("y")]}],
                               "dpo", "Dataset row 4: `prompt`, `chosen` and `rejected` mix text and chat messages"),
    "text and chat in a row without prompt": ([{"chosen": CHAT["chosen"], "rejected": "y"}] * 3, "dpo",
                                              "Dataset row 0: `chosen` and `rejected` mix text and chat messages"),
    "text among chat pairs": ([CHAT, CHAT, {"chosen": "q x", "rejected": "q y"}], "dpo",
                              "Dataset row 2: a text pair among chat pairs (the first row's kind): a source holds "
                              "pairs of one kind"),
    "a text pair without prompt": ([{"chosen": "q x", "rejected": "q y"}] * 3, "dpo",
                                   "Dataset row 0: a text pair without `prompt`: where the prompt ends in the text "
                                   "cannot be told; add a `prompt` column"),
    "chats sharing no turn": ([{"chosen": [user("q"), assistant("x")], "rejected": [user("r"), assistant("y")]}] * 3,
                              "dpo", "Dataset row 0: `chosen` and `rejected` share no leading turn"),
    "a chat that is the other's start": ([{"chosen": CHAT["chosen"], "rejected": [*CHAT["chosen"], user("more"),
                                                                                   assistant("y")]}] * 3, "dpo",
                                         "Dataset row 0: one of `chosen` and `rejected` is the other's start"),
    "a message that is not one": ([{"chosen": [user("q"), "x"], "rejected": CHAT["rejected"]}] * 3, "dpo",
                                  "Dataset row 0: `chosen` must be a list of {role, content} messages"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_pair_is_refused_in_one_line(case, tmp_path, tiny_assets):
    rows, method, message = BAD_ROWS[case]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = Recipe(method=method, model_name_or_path=tiny_assets[0], dataset=str(path), max_seq_length=64)
    with pytest.raises(ConfigError) as refusal:
        load_splits(recipe, AutoTokenizer.from_pretrained(tiny_assets[0]))
    assert len(refusal.value.messages) == 1 and "\n" not in str(refusal.value), refusal.value
    assert message.replace("{path}", str(path)) in str(refusal.value), refusal.value


# --- prepared ahead ---------------------------------------------------------------------------------------------


def test_prepared_pairs_train_as_pairs_tokenized_at_start(tmp_path, tiny_assets, capsys):
    """scripts/prepare_data.py --method dpo writes the pairs a DPO run would tokenize at its start, split alike;
    the run reads them back as they are, and checks them against its own --max_seq_length."""
    rows = [{"prompt": f"rev {word}=", "chosen": word[::-1], "rejected": word} for word in
            ("abc", "bcde", "cdefg", "defghi", "efghij", "fgh", "ghij", "hijab", "ijabcd", "jabcdef")]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe_file = tmp_path / "recipe.py"
    recipe_file.write_text("from shardtune import Recipe\n"
                           f"RECIPE = Recipe(model_name_or_path={tiny_assets[0]!r}, max_seq_length=64)\n")
    out = tmp_path / "prepared"
    flags = ["--method", "dpo", "--dataset", str(path), "--eval_fraction", "0.2"]
    assert load_script("prepare_data").main([str(recipe_file), "--output_dir", str(out), *flags]) == 0
    assert f"8 train and 2 eval pairs in {out}; train with --dataset {out} --max_seq_length 64 --method dpo" in \
        capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    settings = {"model_name_or_path": tiny_assets[0], "max_seq_length": 64, "eval_fraction": 0.2}
    expected = load_splits(dpo_recipe(str(path), **settings), tokenizer)
    loaded = load_splits(dpo_recipe(str(out), **settings), tokenizer)
    for split, reference in zip(loaded, expected, strict=True):
        assert split.column_names == list(PAIR_COLUMNS) and split.to_list() == reference.to_list()
    assert json.loads((out / "shardtune_data.json").read_text())["method"] == "dpo"
    with pytest.raises(ConfigError, match=re.escape(f"{str(out)!r} holds tokenized_pairs rows, which --method sft")):
        load_splits(Recipe(model_name_or_path=tiny_assets[0], dataset=str(out), max_seq_length=64), tokenizer)

"""The data a new user already has: Alpaca and ShareGPT rows, mixtures of sources with weights, chat templates
from a file or bundled, and data tokenized ahead by scripts/prepare_data.py. In process, with real files."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shardtune.config import ConfigError, Recipe
from shardtune.data.loading import load_splits
from shardtune.data.sources import (
    CHAT_TEMPLATES_DIR,
    check_chat_template,
    check_dataset_sources,
    check_dataset_weights,
)
from shardtune.data.templates import apply_chat_template_flag
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.models.tiny_assets import CHAT_TEMPLATE
from tests.conftest import load_script

LLAMA3_MARKERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def words(count: int, letters: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(count)]


def chat_rows(count: int, seed: int = 0) -> list[list[dict]]:
    """Conversations in `messages` form: a system turn, then two exchanges (reverse a word, copy a word)."""
    rows = []
    for first, second in zip(words(count, "abcdefghij", seed), words(count, "klmnopqrst", seed + 1), strict=True):
        rows.append([{"role": "system", "content": "be brief"}, {"role": "user", "content": f"rev {first}="},
                     {"role": "assistant", "content": first[::-1]}, {"role": "user", "content": f"cpy {second}="},
                     {"role": "assistant", "content": second}])
    return rows


SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_sharegpt_and_messages(root: Path, count: int = 64, seed: int = 0) -> tuple[str, str]:
    """The same conversations as ShareGPT (`conversations` of from/value) and as `messages` (role/content):
    training on either must give identical tokens, labels and losses."""
    chats = chat_rows(count, seed)
    sharegpt = [{"conversations": [{"from": SHAREGPT_ROLE[turn["role"]], "value": turn["content"]} for turn in chat]}
                for chat in chats]
    return (write_jsonl(root / "sharegpt.jsonl", sharegpt),
            write_jsonl(root / "messages.jsonl", [{"messages": chat} for chat in chats]))


def alpaca_rows(count: int, letters: str = "abcdefghij", seed: int = 0) -> list[dict]:
    """Half with an `input` (the word to reverse), half with the word in the instruction and an empty input."""
    rows = []
    for index, word in enumerate(words(count, letters, seed)):
        if index % 2:
            rows.append({"instruction": "rev", "input": word, "output": word[::-1]})
        else:
            rows.append({"instruction": f"rev {word}", "input": "", "output": word[::-1]})
    return rows


def recipe(dataset, **overrides) -> Recipe:
    return Recipe(model_name_or_path="tiny", dataset=str(dataset), **{"max_seq_length": 128, **overrides})


@pytest.fixture
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets[0])


@pytest.fixture
def plain_tokenizer(tokenizer):
    """A base-model tokenizer: no chat template."""
    tokenizer.chat_template = None
    return tokenizer


def targets(tokenizer, row: dict) -> str:
    return tokenizer.decode([token for token in row["labels"] if token != IGNORE_INDEX])


def every_row(splits) -> list[dict]:
    return [row for split in splits for row in split]


def test_alpaca_through_the_chat_template_learns_the_output(tmp_path, tokenizer):
    # The tiny template, with newlines shown as `=` (the tiny tokenizer reads any run of newlines as one <unk>).
    tokenizer.chat_template = CHAT_TEMPLATE.replace("message['content']", "message['content'] | replace('\\n', '=')")
    rows = [{"instruction": "rev abc", "input": "", "output": "cba"}, {"instruction": "rev", "input": "abcd",
                                                                       "output": "dcba"}] * 4
    tokenized = every_row(load_splits(recipe(write_jsonl(tmp_path / "alpaca.jsonl", rows)), tokenizer))
    expected = [("<s>user:rev abc>assistant:cba</s>", "cba</s>")] * 4 + [
        ("<s>user:rev==abcd>assistant:dcba</s>", "dcba</s>")] * 4  # the input after a blank line
    assert sorted((tokenizer.decode(row["input_ids"]), targets(tokenizer, row)) for row in tokenized) == expected


def test_alpaca_without_a_chat_template_uses_the_alpaca_prompt(tmp_path, plain_tokenizer):
    tokenizer = plain_tokenizer
    rows = [{"instruction": "rev abc", "output": "cba"}] * 3 + [{"instruction": "rev", "input": "abcd",
                                                                 "output": "dcba"}]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    tokenized = every_row(load_splits(recipe(path, max_seq_length=512), tokenizer))  # one token a character
    prompts = {  # Stanford Alpaca's two prompts, written out
        "cba": "Below is an instruction that describes a task. Write a response that appropriately completes the "
               "request.\n\n### Instruction:\nrev abc\n\n### Response:",
        "dcba": "Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\nrev\n\n### Input:\n"
                "abcd\n\n### Response:",
    }
    for row in tokenized:
        output = targets(tokenizer, row).removesuffix("</s>")
        expected = tokenizer(prompts[output])["input_ids"] + tokenizer(output, add_special_tokens=False)["input_ids"]
        assert row["input_ids"] == expected + [tokenizer.eos_token_id]
    assert sorted(targets(tokenizer, row) for row in tokenized) == ["cba</s>"] * 3 + ["dcba</s>"]


def test_sharegpt_equals_messages_and_learns_every_assistant_turn(tmp_path, tokenizer):
    sharegpt, messages = write_sharegpt_and_messages(tmp_path, count=24)
    from_sharegpt, from_messages = load_splits(recipe(sharegpt), tokenizer), load_splits(recipe(messages), tokenizer)
    for ours, reference in zip(from_sharegpt, from_messages, strict=True):
        assert ours["input_ids"] == reference["input_ids"] and ours["labels"] == reference["labels"]
    expected = {"".join(turn["content"] + "</s>" for turn in chat if turn["role"] == "assistant")
                for chat in chat_rows(24)}
    assert {targets(tokenizer, row) for row in every_row(from_sharegpt)} == expected


def test_sharegpt_role_names_and_unknown_roles(tmp_path, tokenizer):
    chat = [{"from": "user", "value": "rev ab="}, {"from": "assistant", "value": "ba"}]
    train, _ = load_splits(recipe(write_jsonl(tmp_path / "a.jsonl", [{"conversations": chat}] * 4)), tokenizer)
    assert targets(tokenizer, train[0]) == "ba</s>"
    rows = [{"conversations": chat}] * 2 + [{"conversations": [{"from": "bot", "value": "ba"}]}]
    with pytest.raises(ConfigError, match=re.escape("Dataset row 2: unknown ShareGPT role 'bot'")):
        load_splits(recipe(write_jsonl(tmp_path / "b.jsonl", rows), dataset_format="sharegpt"), tokenizer)


def test_chat_rows_without_a_template_name_the_flag(tmp_path, plain_tokenizer):
    sharegpt, messages = write_sharegpt_and_messages(tmp_path, count=4)
    for path in (sharegpt, messages):
        with pytest.raises(ConfigError, match="has no chat template .* pass --chat_template .*chatml, llama3"):
            load_splits(recipe(path), plain_tokenizer)


def test_bundled_template_is_applied_learnt_and_saved(tmp_path, plain_tokenizer, caplog):
    """--chat_template llama3 on a tokenizer without one: its assistant spans carry the loss (prefix rendering),
    and the template is saved with the tokenizer (which the trainer writes beside checkpoints and the model)."""
    tokenizer = plain_tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_MARKERS})  # as Llama 3 tokenizers have them
    _, messages = write_sharegpt_and_messages(tmp_path, count=8)
    with caplog.at_level(logging.WARNING, logger="shardtune.data.loading"):
        train, _ = load_splits(recipe(messages, chat_template="llama3"), tokenizer)
    assert "not tokens of this tokenizer" not in caplog.text
    assert re.fullmatch(r"[a-j]+<\|eot_id\|>[k-t]+<\|eot_id\|>", targets(tokenizer, train[0]))
    assert tokenizer.decode(train[0]["input_ids"]).startswith("<s><|start_header_id|>system<|end_header_id|>")
    tokenizer.save_pretrained(tmp_path / "saved")
    template = (Path(CHAT_TEMPLATES_DIR) / "llama3.jinja").read_text()
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == template


def test_template_from_a_file_and_split_markers_warned(tmp_path, plain_tokenizer, caplog):
    path = tmp_path / "mine.jinja"
    path.write_text((Path(CHAT_TEMPLATES_DIR) / "chatml.jinja").read_text())
    with caplog.at_level(logging.WARNING, logger="shardtune.data.loading"):
        apply_chat_template_flag(plain_tokenizer, recipe("x", chat_template=str(path)))
    assert "<|im_end|>, <|im_start|> are not tokens of this tokenizer" in caplog.text
    rendered = plain_tokenizer.apply_chat_template(chat_rows(1)[0][:3], tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n" + chat_rows(1)[0][2]["content"] + "<|im_end|>\n")


@pytest.mark.parametrize("value", ["llama4", "./missing.jinja"])
def test_unknown_template_lists_the_bundled_ones(value):
    with pytest.raises(ConfigError, match=re.escape(f"--chat_template {value!r} is neither a Jinja file nor a "
                                                    "bundled template: give a file path or one of chatml, llama3.")):
        check_chat_template(recipe("x", chat_template=value))


def mixture_files(root: Path) -> tuple[str, str]:
    """40 Alpaca rows on letters a-j and 30 ShareGPT rows on letters k-t: each row tells its source."""
    alpaca = write_jsonl(root / "a.jsonl", alpaca_rows(40))
    chats = [[{"from": "human", "value": f"rev {word}="}, {"from": "gpt", "value": word[::-1]}]
             for word in words(30, "klmnopqrst", seed=5)]
    return alpaca, write_jsonl(root / "b.jsonl", [{"conversations": chat} for chat in chats])


def test_mixture_takes_each_share_with_the_seed(tmp_path, tokenizer, caplog):
    alpaca, sharegpt = mixture_files(tmp_path)
    mixed = recipe(f"{alpaca}, {sharegpt}", dataset_weights="1.0,0.5", eval_fraction=0.1)
    with caplog.at_level(logging.WARNING, logger="shardtune.data.loading"):
        splits = load_splits(mixed, tokenizer)
    assert f"{alpaca}: 40 of 40 rows (alpaca); {sharegpt}: 15 of 30 rows (sharegpt)" in caplog.text
    rows = every_row(splits)
    sources = [targets(tokenizer, row)[0] in "abcdefghij" for row in rows]
    assert (sources.count(True), sources.count(False), len(splits[1])) == (40, 15, 6)
    all_b = {targets(tokenizer, row) for row in every_row(load_splits(recipe(sharegpt), tokenizer))}
    drawn = {targets(tokenizer, row) for row, a in zip(rows, sources, strict=True) if not a}
    first_half = {word[::-1] + "</s>" for word in words(30, "klmnopqrst", seed=5)[:15]}
    assert drawn < all_b and drawn != first_half  # drawn at random, not the file's first rows
    again = load_splits(mixed, tokenizer)
    assert [split["input_ids"] for split in again] == [split["input_ids"] for split in splits]
    reseeded = load_splits(dataclasses.replace(mixed, seed=1), tokenizer)
    assert reseeded[0]["input_ids"] != splits[0]["input_ids"]
    assert sources[:20] != sorted(sources[:20])  # shuffled: not the first source's rows, then the second's


BAD_WEIGHTS = {
    "1.0": "gives 1 weight(s) for 2 --dataset source(s)",
    "1.0,half": "--dataset_weights 'half' is not a share",
    "1.0,0": "--dataset_weights '0' is not a share",
    "1.5,1.0": "--dataset_weights '1.5' is not a share",
    "nan,1.0": "--dataset_weights 'nan' is not a share",
}


@pytest.mark.parametrize("weights", BAD_WEIGHTS)
def test_bad_weights_are_refused_before_loading(weights, tmp_path):
    paths = [write_jsonl(tmp_path / f"{name}.jsonl", alpaca_rows(2)) for name in "ab"]
    with pytest.raises(ConfigError, match=re.escape(BAD_WEIGHTS[weights])):
        check_dataset_weights(recipe(",".join(paths), dataset_weights=weights))
    with pytest.raises(ConfigError, match=re.escape(BAD_WEIGHTS[weights])):
        load_splits(recipe(",".join(paths), dataset_weights=weights), tokenizer=None)  # refused before any load


def test_every_source_of_a_mixture_is_checked(tmp_path):
    present = write_jsonl(tmp_path / "a.jsonl", alpaca_rows(2))
    with pytest.raises(ConfigError, match=re.escape("Dataset file not found: 'data/missing.jsonl'")):
        check_dataset_sources(recipe(f"{present},data/missing.jsonl"))
    with pytest.raises(ConfigError, match="empty source between commas"):
        check_dataset_sources(recipe(f"{present},,{present}"))
    check_dataset_sources(recipe(f"{present}, {present}"))


def test_prepared_data_trains_without_tokenizing_again(tmp_path, tiny_assets, capsys):
    alpaca, sharegpt = mixture_files(tmp_path)
    recipe_file = tmp_path / "recipe.py"
    recipe_file.write_text("from shardtune import Recipe\n"
                           f"RECIPE = Recipe(model_name_or_path={tiny_assets[0]!r}, max_seq_length=64)\n")
    out = tmp_path / "prepared"
    flags = ["--dataset", f"{alpaca},{sharegpt}", "--dataset_weights", "0.5,1", "--chat_template", "chatml"]
    assert load_script("prepare_data").main([str(recipe_file), "--output_dir", str(out), *flags]) == 0
    assert f"--dataset {out} --max_seq_length 64" in capsys.readouterr().out
    expected = load_splits(recipe(f"{alpaca},{sharegpt}", max_seq_length=64, dataset_weights="0.5,1",
                                  chat_template="chatml"), AutoTokenizer.from_pretrained(tiny_assets[0]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    loaded = load_splits(recipe(out, max_seq_length=64, chat_template="chatml"), tokenizer)
    for split, reference in zip(loaded, expected, strict=True):
        assert split["input_ids"] == reference["input_ids"] and split["labels"] == reference["labels"]
        assert all(Path(cache["filename"]).is_relative_to(out) for cache in split.cache_files)  # nothing new
    with pytest.raises(ConfigError, match="holds tokenized rows of up to .* more than --max_seq_length 16"):
        load_splits(recipe(out, max_seq_length=16), tokenizer)
    assert load_script("prepare_data").main([str(recipe_file), "--output_dir", str(out), *flags]) == 2
    assert "already exists" in capsys.readouterr().err


def test_prepare_data_refuses_training_only_flags(tmp_path, tiny_assets, capsys):
    """A flag that acts only in training (--learning_rate, --packing_strategy ...) would be accepted and do
    nothing here: refused in one line, before anything is read."""
    recipe_file = tmp_path / "recipe.py"
    recipe_file.write_text("from shardtune import Recipe\n"
                           f"RECIPE = Recipe(model_name_or_path={tiny_assets[0]!r}, max_seq_length=64)\n")
    argv = [str(recipe_file), "--output_dir", str(tmp_path / "out"), "--learning_rate=1e-4", "--packing", "true",
            "--max_seq_length", "32"]
    assert load_script("prepare_data").main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--learning_rate, --packing: not used in preparing data" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_a_template_refusal_names_the_row(tmp_path, tokenizer):
    path = tmp_path / "strict.jinja"
    path.write_text("{% for message in messages %}{% if message['role'] == 'system' %}"
                    "{{ raise_exception('this template takes no system turn') }}{% endif %}"
                    "{{ message['role'] + ':' + message['content'] }}{% endfor %}")
    chats = chat_rows(3)
    rows = [{"messages": chats[0][1:]}, {"messages": chats[1]}, {"messages": chats[2][1:]}]
    with pytest.raises(ConfigError, match=re.escape("Dataset row 1: this template takes no system turn")):
        load_splits(recipe(write_jsonl(tmp_path / "chat.jsonl", rows), chat_template=str(path)), tokenizer)



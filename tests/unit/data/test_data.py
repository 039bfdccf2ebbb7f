"""Fine-tuning data: every source and format loads through `datasets`, only completion / assistant tokens carry
loss, bad data is refused with the place it went wrong, and packing isolates sequences exactly."""

from __future__ import annotations

import json
import re

import pytest
import torch
from datasets import Dataset, DatasetDict
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.config import ConfigError, Recipe
from shardtune.data.batches import COUNTS, make_collator
from shardtune.data.loading import load_splits
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.models.tiny_assets import reversal_examples
from tests.conftest import REPO

ROWS = reversal_examples(64, seed=1)


def recipe(dataset, **overrides) -> Recipe:
    return Recipe(model_name_or_path="", dataset=str(dataset), **{"max_seq_length": 64, **overrides})


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets[0])


def as_messages(row: dict) -> dict:
    return {"messages": [{"role": "user", "content": row["prompt"]},
                         {"role": "assistant", "content": row["completion"]}]}


def write_sources(root) -> dict[str, str]:
    """The same rows as jsonl, json, parquet, csv and a save_to_disk directory; plus text and chat jsonl."""
    data = Dataset.from_list(ROWS)
    paths = {kind: str(root / f"rows.{kind}") for kind in ("jsonl", "json", "parquet", "csv")}
    data.to_json(paths["jsonl"])
    (root / "rows.json").write_text(json.dumps(ROWS))
    data.to_parquet(paths["parquet"])
    data.to_csv(paths["csv"], index=False)
    paths["save_to_disk"] = str(root / "saved")
    DatasetDict({"train": data, "validation": data.select(range(8))}).save_to_disk(paths["save_to_disk"])
    paths["text"] = str(root / "text.jsonl")
    Dataset.from_list([{"text": row["prompt"] + row["completion"]} for row in ROWS]).to_json(paths["text"])
    paths["messages"] = str(root / "chat.jsonl")
    Dataset.from_list([as_messages(row) for row in ROWS]).to_json(paths["messages"])
    return paths


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("sources"))


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "save_to_disk"])
def test_every_source_gives_the_same_tokens(kind, sources, tokenizer):
    train, evaluation = load_splits(recipe(sources[kind]), tokenizer)
    reference, _ = load_splits(recipe(sources["jsonl"]), tokenizer)
    assert len(train) + len(evaluation) == len(ROWS)
    assert train["input_ids"] == reference["input_ids"] and train["labels"] == reference["labels"]


def test_eval_split_by_name_or_file(sources, tokenizer):
    train, evaluation = load_splits(recipe(sources["save_to_disk"], eval_split="validation"), tokenizer)
    assert (len(train), len(evaluation)) == (64, 8)
    train, evaluation = load_splits(recipe(sources["jsonl"], eval_split=sources["csv"]), tokenizer)
    assert (len(train), len(evaluation)) == (64, 64)


def decoded_targets(tokenizer, row: dict) -> str:
    return tokenizer.decode([token for token in row["labels"] if token != IGNORE_INDEX])


def test_prompt_and_chat_tokens_carry_no_loss(sources, tokenizer):
    """The loss covers exactly the completion (the reversed word) and the end-of-sequence token."""
    for kind, prompt_end in (("jsonl", "="), ("messages", "=>assistant:")):
        train, _ = load_splits(recipe(sources[kind]), tokenizer)
        for row in train:
            text, targets = tokenizer.decode(row["input_ids"]), decoded_targets(tokenizer, row)
            assert text.endswith(targets) and targets.endswith(tokenizer.eos_token), (kind, text, targets)
            prompt = text[: -len(targets)]
            word = prompt.split("rev ")[1].split("=")[0]
            assert prompt.endswith(prompt_end) and targets == word[::-1] + tokenizer.eos_token, (kind, text)
    train, _ = load_splits(recipe(sources["text"]), tokenizer)
    assert all(IGNORE_INDEX not in row["labels"] for row in train)  # continued pretraining: every token
    train, _ = load_splits(recipe(sources["jsonl"], completion_only_loss=False), tokenizer)
    assert all(row["labels"] == row["input_ids"] for row in train)


def test_chat_with_several_turns_learns_every_assistant_turn(tmp_path, tokenizer):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "rev ab="},
            {"role": "assistant", "content": "ba"}, {"role": "user", "content": "rev abc="},
            {"role": "assistant", "content": "cba"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": chat}) for _ in range(4)))
    train, _ = load_splits(recipe(path, max_seq_length=128), tokenizer)
    assert decoded_targets(tokenizer, train[0]) == "ba</s>cba</s>"


@pytest.mark.parametrize("data_format", ["prompt_completion", "text"])
def test_a_target_that_ends_with_eos_gets_no_second_one(data_format, tmp_path, tokenizer):
    """A completion (or text) whose text already ends with the EOS token keeps that one EOS, trained once; one
    without it still gets one."""
    eos = tokenizer.eos_token
    rows = [("rev abc=", "cba" + eos), ("rev ab=", "ba"), ("rev abcd=", "dcba" + eos), ("rev abcde=", "edcba")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": prompt, "completion": completion} if data_format != "text"
                                       else {"text": prompt + completion}) + "\n" for prompt, completion in rows))
    train, _ = load_splits(recipe(path, eval_split=str(path)), tokenizer)  # every row, in order
    for (prompt, completion), row in zip(rows, train, strict=True):
        assert row["input_ids"].count(tokenizer.eos_token_id) == 1 and row["input_ids"][-1] == tokenizer.eos_token_id
        assert row["labels"].count(tokenizer.eos_token_id) == 1 and row["labels"][-1] == tokenizer.eos_token_id
        learnt = decoded_targets(tokenizer, row)
        assert learnt == (completion.removesuffix(eos) + eos if data_format != "text"
                          else tokenizer.bos_token + prompt + completion.removesuffix(eos) + eos), learnt


def test_over_long_rows_are_truncated_or_dropped(sources, tokenizer):
    train, evaluation = load_splits(recipe(sources["jsonl"], max_seq_length=16), tokenizer)
    assert max(len(ids) for ids in train["input_ids"]) == 16 and len(train) + len(evaluation) == len(ROWS)
    kept, held = load_splits(recipe(sources["jsonl"], max_seq_length=16, truncation="drop"), tokenizer)
    assert 0 < len(kept) + len(held) < len(ROWS)
    assert all(ids[-1] == tokenizer.eos_token_id for ids in kept["input_ids"])


def test_tokenization_is_cached_and_reused(sources, tokenizer):
    first, _ = load_splits(recipe(sources["parquet"]), tokenizer)
    second, _ = load_splits(recipe(sources["parquet"]), tokenizer)
    assert first.cache_files and first.cache_files == second.cache_files


BAD_DATA = {
    "unknown columns": ([{"question": "a", "answer": "b"}] * 4, {}, "match no known format"),
    "missing column for the format": (ROWS, {"dataset_format": "messages"}, "needs column(s) ['messages']"),
    "chat without an assistant turn": ([{"messages": [{"role": "user", "content": "rev ab="}]}] * 4, {},
                                       "Dataset row 0: the chat has no assistant turn"),
    "empty": ([], {}, "is empty"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_named(case, tmp_path, tokenizer):
    rows, overrides, message = BAD_DATA[case]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_splits(recipe(path, **overrides), tokenizer)


def test_unparsable_file_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{\"prompt\": \"rev a=\", \n")
    with pytest.raises(ConfigError, match="line 3 is not valid JSON"):
        load_splits(recipe(path), tokenizer)


def per_token_losses(model, batch: dict) -> torch.Tensor:
    """Each target token's loss (the collator's host-side counts are not model inputs)."""
    logits = model(**{key: value for key, value in batch.items() if key not in ("labels", COUNTS)}).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none",
                                               ignore_index=IGNORE_INDEX)
    return losses[labels != IGNORE_INDEX]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_gives_each_sequence_its_own_losses(attn, sources, tokenizer, tiny_assets):
    """A packed row of 8 sequences: every target token's loss equals the one of the sequence alone, so no
    sequence attends to another; and the mean loss and gradients equal the padded batch's."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False  # as in training (shardtune.model): a cache turns packed-sequence masks off
    train, _ = load_splits(recipe(sources["jsonl"]), tokenizer)
    rows = [train[i] for i in range(8)]
    packed = make_collator(tokenizer, packing=True)(rows)
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    alone = torch.cat([per_token_losses(model, make_collator(tokenizer)([row])) for row in rows])
    torch.testing.assert_close(per_token_losses(model, packed), alone, rtol=1e-5, atol=1e-6)

    padded = make_collator(tokenizer)(rows)
    grads = []
    for batch in (padded, packed):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=0)
    for padded_grad, packed_grad in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(packed_grad, padded_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_padding_to_a_multiple_changes_no_loss_or_gradient(packing, sources, tokenizer, tiny_assets):
    """--pad_to_multiple_of 16: every target token's loss, the mean loss and the gradients as without padding
    (a packed row's padding is a sequence of its own, which no other attends to)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    train, _ = load_splits(recipe(sources["jsonl"]), tokenizer)
    rows = [train[i] for i in range(5)]
    batches = [make_collator(tokenizer, packing=packing, multiple=multiple)(rows) for multiple in (1, 16)]
    assert batches[0]["input_ids"].shape[1] % 16 and batches[1]["input_ids"].shape[1] % 16 == 0
    torch.testing.assert_close(per_token_losses(model, batches[1]), per_token_losses(model, batches[0]),
                               rtol=1e-5, atol=1e-6)
    grads = []
    for batch in batches:
        model.zero_grad()
        loss = model(**{key: value for key, value in batch.items() if key != COUNTS}).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=0)
    for plain, padded in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(padded, plain, rtol=1e-4, atol=1e-6)


def token_utilization(dataset, tokenizer, packing: bool, micro_batch: int = 16) -> float:
    """The sequences' own tokens over the positions the model is really given: every row of the dataset counted
    from the dataset, every position counted from the batches the collator builds (not from its own counts)."""
    loader = DataLoader(dataset, batch_size=micro_batch, collate_fn=make_collator(tokenizer, packing=packing))
    processed = 0
    for batch in loader:
        processed += batch["input_ids"].numel()
    return sum(len(ids) for ids in dataset["input_ids"]) / processed


def test_packing_wastes_no_token_on_the_demo_data(tiny_assets, tokenizer):
    """The table of docs/data.md, to its three decimals."""
    train, _ = load_splits(recipe(tiny_assets[1]), tokenizer)
    padded, packed = token_utilization(train, tokenizer, False), token_utilization(train, tokenizer, True)
    print(f"token utilization on the demo data, micro-batch 16: padded {padded:.3f}, packed {packed:.3f}")
    assert (f"{padded:.3f}", f"{packed:.3f}") == ("0.785", "1.000")
    page = (REPO / "docs" / "data.md").read_text()
    assert f"| padded | {padded:.3f} |" in page and f"| packed | {packed:.3f} |" in page, "update docs/data.md"

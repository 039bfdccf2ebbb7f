"""--packing_strategy bfd: the training sequences bin-packed into rows of --max_seq_length tokens (TRL's
pack_dataset), each sequence trained exactly as it is alone, the rows nearly full on chats of varied length, and
the planner planning a packed micro-batch as the full rows it now is."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
import torch
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.config import Recipe
from shardtune.data.batches import COUNTS, make_collator
from shardtune.data.loading import load_splits
from shardtune.data.packing import SEQUENCE_LENGTHS, fill_ratio, pack_rows
from shardtune.models.flops import resolve_model
from shardtune.models.tiny_assets import TASK_LETTERS, reversal_examples
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.planned_run import plan_recipe
from shardtune.plan.planner import plan
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config
from tests.conftest import REPO
from tests.unit.data.test_data import per_token_losses

MIN_FILL = 0.95  # of --max_seq_length, on chats of varied length


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets[0])


def bfd(dataset: str, **overrides) -> Recipe:
    values = {"model_name_or_path": "", "dataset": dataset, "max_seq_length": 64, "packing": True,
              "packing_strategy": "bfd", **overrides}
    return Recipe(**values)


@pytest.fixture(scope="module")
def reversal_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("bfd") / "rows.jsonl")
    Dataset.from_list(reversal_examples(96, seed=5)).to_json(path)
    return path


def sequences_of(dataset: Dataset) -> Counter:
    return Counter(tuple(zip(row["input_ids"], row["labels"], strict=True)) for row in dataset)


def test_rows_hold_every_sequence_once_within_max_seq_length(reversal_file, tokenizer):
    """Every training sequence lands in exactly one row, whole; no row is longer than --max_seq_length; and a
    micro-batch of one row holds several sequences, which the collator counts."""
    recipe = bfd(reversal_file)
    train, _ = load_splits(recipe, tokenizer)
    packed = pack_rows(train, recipe)
    assert len(packed) < len(train) / 3  # sequences of 10-15 tokens, rows of 64
    assert max(len(ids) for ids in packed["input_ids"]) <= recipe.max_seq_length
    assert all(sum(row[SEQUENCE_LENGTHS]) == len(row["input_ids"]) for row in packed)
    unpacked = Dataset.from_list([{"input_ids": row["input_ids"][start:start + length],
                                   "labels": row["labels"][start:start + length]}
                                  for row in packed
                                  for start, length in zip(offsets(row[SEQUENCE_LENGTHS]), row[SEQUENCE_LENGTHS],
                                                           strict=True)])
    assert sequences_of(unpacked) == sequences_of(train)
    counts = make_collator(tokenizer, packing=True)([packed[0]])[COUNTS]
    assert counts["sequences"] == len(packed[0][SEQUENCE_LENGTHS]) > 1
    assert counts["tokens"] == counts["processed"] == len(packed[0]["input_ids"])
    assert pack_rows(train, bfd(reversal_file, packing_strategy="padding_free")) is train


def offsets(lengths: list[int]) -> list[int]:
    return [sum(lengths[:index]) for index in range(len(lengths))]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_packed_sequence_gets_the_losses_it_gets_alone(attn, reversal_file, tokenizer, tiny_assets):
    """A micro-batch of two bfd rows: every target token's loss equals its loss in its sequence alone (position
    ids restart per sequence, and transformers isolates attention per sequence from them on CPU), and the
    collator's target count, the trainer's loss divisor, is the sequences' own."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False  # as in training (shardtune.model): a cache turns packed-sequence masks off
    recipe = bfd(reversal_file)
    rows = [pack_rows(load_splits(recipe, tokenizer)[0], recipe)[index] for index in range(2)]
    batch = make_collator(tokenizer, packing=True, attn_implementation=attn)(rows)
    assert batch["input_ids"].shape == (1, sum(len(row["input_ids"]) for row in rows))
    alone = [make_collator(tokenizer)([{"input_ids": row["input_ids"][start:start + length],
                                        "labels": row["labels"][start:start + length]}])
             for row in rows for start, length in zip(offsets(row[SEQUENCE_LENGTHS]), row[SEQUENCE_LENGTHS],
                                                      strict=True)]
    assert batch[COUNTS]["sequences"] == len(alone) > 2
    assert batch[COUNTS]["targets"] == sum(single[COUNTS]["targets"] for single in alone)
    with torch.no_grad():
        expected = torch.cat([per_token_losses(model, single) for single in alone])
        torch.testing.assert_close(per_token_losses(model, batch), expected, rtol=1e-5, atol=1e-6)


def write_chats(path: str, count: int, seed: int) -> None:
    """Chats of one to three exchanges, message lengths log-normal (median about 55 and 90 characters, a long
    tail), one token a character with the tiny tokenizer: rows from a few dozen tokens to over 1,024."""
    rng = random.Random(seed)

    def text(mean_log: float) -> str:
        return "".join(rng.choice(TASK_LETTERS) for _ in range(max(1, int(rng.lognormvariate(mean_log, 0.8)))))

    chats = [{"messages": [message for _ in range(rng.randint(1, 3))
                           for message in ({"role": "user", "content": text(4.0)},
                                           {"role": "assistant", "content": text(4.5)})]}
             for _ in range(count)]
    Dataset.from_list(chats).to_json(path)


def test_rows_are_at_least_95_percent_full_on_chats_of_varied_length(tmp_path, tokenizer, caplog):
    """The figures of docs/data.md: the start-up line and the fill, measured on the collated micro-batches."""
    path = str(tmp_path / "chats.jsonl")
    write_chats(path, 800, seed=0)
    recipe = bfd(path, max_seq_length=1024)
    train, _ = load_splits(recipe, tokenizer)
    lengths = [len(ids) for ids in train["input_ids"]]
    with caplog.at_level("WARNING", logger="shardtune.data.packing"):
        packed = pack_rows(train, recipe)
    fill = fill_ratio(packed, recipe.max_seq_length)
    # Measured from the batches the collator builds, not from the dataset: one row per micro-batch.
    loader = DataLoader(packed, batch_size=1, collate_fn=make_collator(tokenizer, packing=True))
    tokens_per_row = [batch["input_ids"].numel() for batch in loader]
    assert sum(tokens_per_row) == sum(lengths) and fill == sum(tokens_per_row) / (len(packed) * 1024)
    assert fill >= MIN_FILL
    page = " ".join((REPO / "docs" / "data.md").read_text().split())
    logged = [record for record in caplog.records if record.name == "shardtune.data.packing"][-1].getMessage()
    assert f"`{logged}`" in page, f"update docs/data.md: {logged}"
    assert (f"{min(lengths)} to {max(lengths):,} tokens (mean {sum(lengths) / len(lengths):.0f})" in page
            and f"give {len(packed)} rows with {fill:.3f} of their positions" in page), "update docs/data.md"


def test_planned_activations_of_bfd_are_those_of_full_rows():
    """The planner already plans a packed micro-batch as one row of micro-batch x --max_seq_length tokens; with
    bfd that is what the rows hold (up to the last fraction of a row), so the plan of a bfd recipe is the plan of
    that many full rows of sequence tokens, with no mask (flex attention)."""
    shape, hardware = resolve_model("llama-3.1-8b"), parse_hardware("8xh100-80gb")
    strategy = read_accelerate_config(os.path.join(CONFIGS_DIR, "ddp.yaml"), "bf16")
    for micro_batch in (1, 2):
        recipe = Recipe(packing=True, packing_strategy="bfd", per_device_train_batch_size=micro_batch,
                        max_seq_length=4096, attn_implementation="flex_attention", gradient_checkpointing=True)
        full_row = plan(shape, hardware, strategy, 1, micro_batch * 4096, True, "flash",
                        chunked_cross_entropy=recipe.chunked_cross_entropy)
        assert plan_recipe(shape, hardware, strategy, recipe).per_gpu["activations"] == \
            full_row.per_gpu["activations"]

"""flex_attention on packed rows, run for real: its forward equals padded SDPA's per-token loss (its backward
needs a GPU in this torch). The step's device rules on the meta device are in tests/unit/test_step.py."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.data.batches import COUNTS, make_collator
from tests.unit.test_step import features


def test_flex_attention_forward_equals_padded_sdpa_on_packed_rows(tiny_assets):
    """flex_attention isolates the packed sequences through a block mask, not a dense one; its backward only
    runs on a GPU in this torch, its forward runs here: each token's loss equals the padded SDPA loss."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    rows = features(tokenizer)
    padded = make_collator(tokenizer)(rows)
    packed = make_collator(tokenizer, packing=True, attn_implementation="flex_attention")(rows)
    losses = {}
    for attn, batch in (("sdpa", padded), ("flex_attention", packed)):
        model = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32, attn_implementation=attn)
        model.config.use_cache = False  # as in training: a cache turns the packed-sequence masks off
        batch = {key: value for key, value in batch.items() if key != COUNTS}
        with torch.no_grad():
            losses[attn] = model(**batch).loss
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], rtol=1e-5, atol=1e-6)



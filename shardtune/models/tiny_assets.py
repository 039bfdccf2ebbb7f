"""A tiny Llama (or a tiny model of another family: shardtune.models.tiny), its character tokenizer and a
synthetic instruction task, made locally for the CPU demo and tests. The model is saved with `save_pretrained` and
read back by the same `from_pretrained` path as real runs."""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import tempfile
from typing import TYPE_CHECKING

# torch, tokenizers and transformers' Llama are imported only where the assets are made, not by a recipe that finds
# them made (every run after the first).
if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = string.ascii_lowercase + string.digits + " =:>"
TASK_LETTERS = "abcdefghij"
# A minimal chat template in the tokenizer's alphabet: `user:rev abc=>assistant:cba</s>`.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ':' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)  # reversal over 10 letters: chance accuracy per target token is about 1/10


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; BOS prepended; decoding joins characters back."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama_config(vocab_size: int, **overrides) -> LlamaConfig:
    return tiny_config(vocab_size, "llama", **overrides)


def tiny_config(vocab_size: int, model_type: str = "llama", **overrides) -> PretrainedConfig:
    """The tiny random config of a family (shardtune.models.tiny)."""
    from transformers import AutoConfig

    from shardtune.models.tiny import tiny_config_values

    return AutoConfig.for_model(model_type, **tiny_config_values(model_type, vocab_size, **overrides))


def reversal_examples(count: int, seed: int) -> list[dict]:
    """`rev abcd=` -> `dcba`: learnable by a two-layer model, checkable per token."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        word = "".join(rng.choice(TASK_LETTERS) for _ in range(rng.randint(3, 8)))
        rows.append({"prompt": f"rev {word}=", "completion": word[::-1]})
    return rows


def preference_examples(count: int, seed: int) -> list[dict]:
    """Reversal pairs: the reversed word chosen over a wrong answer (the word as it is, or reversed with two
    letters swapped)."""
    rng = random.Random(seed)
    rows = []
    for row in reversal_examples(count, seed):
        word = row["completion"]
        wrong = word[::-1] if rng.random() < 0.5 else word[1] + word[0] + word[2:]
        rows.append({"prompt": row["prompt"], "chosen": word, "rejected": wrong if wrong != word else word + word[-1]})
    return rows


def ensure_tiny_preferences(root: str, count: int = 2048, seed: int = 1) -> str:
    """The tiny task's preference pairs (`--method dpo` on recipes/tiny.py), written once beside its data, as
    ensure_tiny_assets writes those."""
    path = os.path.join(root, "preferences.jsonl")
    if not os.path.isfile(path):
        scratch = tempfile.mkstemp(prefix=".preferences-", dir=root)[1]
        with open(scratch, "w") as file:
            file.writelines(json.dumps(row) + "\n" for row in preference_examples(count, seed))
        os.replace(scratch, path)
    return path


def write_tiny_assets(root: str, num_examples: int = 4096, seed: int = 0, save_dtype: torch.dtype | None = None,
                      model_type: str = "llama", **config_overrides) -> None:
    """Write `root/model` (config, random weights of the `model_type` family's tiny model stored in `save_dtype`,
    default fp32, tokenizer) and `root/data.jsonl`."""
    import torch
    from transformers import AutoModelForCausalLM

    os.makedirs(os.path.join(root, "model"))
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tokenizer), model_type, **config_overrides))
    model.to(save_dtype or torch.float32).save_pretrained(os.path.join(root, "model"))
    tokenizer.save_pretrained(os.path.join(root, "model"))
    with open(os.path.join(root, "data.jsonl"), "w") as file:
        for row in reversal_examples(num_examples, seed):
            file.write(json.dumps(row) + "\n")


def ensure_tiny_assets(root: str) -> tuple[str, str]:
    """Create the assets once. Every rank may call this: each writes a private copy and renames it into
    place; the first rename wins and the content is identical (seeded), so no rank reads a half-written file."""
    if not os.path.isdir(root):
        os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=".tiny-", dir=os.path.dirname(os.path.abspath(root)))
        write_tiny_assets(os.path.join(scratch, "assets"))
        try:
            os.rename(os.path.join(scratch, "assets"), root)
        except OSError:
            pass  # another rank was first
        shutil.rmtree(scratch, ignore_errors=True)
    return os.path.join(root, "model"), os.path.join(root, "data.jsonl")

"""Models and data a new user brings, judged before anything heavy: a model of another architecture, a model
directory missing its weights, a shard or its tokenizer, a config.json missing sizes; data that is not UTF-8,
JSON that does not parse, rows of two formats in one file, rows missing a field, OpenAI's content parts. Each is
one line naming the problem and the fix, before tokenization and before a weight loads (the recipe's entry
point, `--dry_run` and the planner alike), or is accepted and trained as it should be."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from shardtune.config import ConfigError, Recipe
from shardtune.data.loading import load_splits
from shardtune.data.sources import check_dataset_sources
from shardtune.models.flops import SUPPORTED_MODEL_TYPES, ModelError, resolve_model
from shardtune.models.tiny_assets import build_tokenizer
from shardtune.plan.__main__ import main as plan_main
from tests.unit.checks.test_bad_input import Case, refused

ARCHITECTURE = "shardtune plans and trains dense decoders of model_type llama, mistral, qwen2, qwen3, gemma3_text"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    """A tiny GPT-2 (no intermediate_size in its config), saved as a user's model directory is."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("models") / "gpt2"
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def model_copy(tiny_assets, root: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """The tiny Llama's directory, copied without the files named."""
    target = root / "model"
    shutil.copytree(tiny_assets[0], target, ignore=lambda _, names: [name for name in names if name in leave_out])
    return target


# --- the model ------------------------------------------------------------------------------------------------


def test_other_architecture_is_refused_at_launch_in_dry_run_and_by_the_planner(gpt2_dir, tiny_assets, tmp_path,
                                                                               capsys, monkeypatch):
    """Before: AttributeError: 'GPT2Config' object has no attribute 'intermediate_size' (a traceback) at launch,
    under --dry_run and in `python -m shardtune.plan`."""
    expected = f"'{gpt2_dir}' is a gpt2 model (GPT2LMHeadModel): {ARCHITECTURE}"
    for args in (("--model_name_or_path", gpt2_dir),
                 ("--model_name_or_path", gpt2_dir, "--dry_run", "true", "--hardware", "1xh100-80gb",
                  "--config_file", "accelerate_configs/ddp.yaml")):
        lines, stderr = refused(Case(args, expected), tiny_assets, tmp_path, capsys, monkeypatch)
        assert len(lines) == 1 and expected in lines[0], stderr[-2000:]
    for model in (gpt2_dir, f"{gpt2_dir}/config.json"):
        assert plan_main(["--model", model]) == 2
        stderr = capsys.readouterr().err
        assert "Traceback" not in stderr and f"shardtune.plan: error: {expected}" in stderr, stderr[-2000:]
    with pytest.raises(ModelError, match=re.escape(expected)):
        resolve_model(gpt2_dir)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_supported_architectures_are_planned_exactly(model_type):
    """What is accepted is what the shape counts: each supported family's parameters, as the planner counts them
    from the config, equal the model's own (built on the meta device)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from shardtune.models.flops import shape_from_config

    # The family's own defaults beside these sizes (Gemma 3's head_dim 256, tied embeddings, sliding layers).
    config = CONFIG_MAPPING[model_type](vocab_size=96, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    with torch.device("meta"):  # accelerate's init_empty_weights unties a tied head
        model = AutoModelForCausalLM.from_config(config)
    assert shape_from_config(config).params == sum(parameter.numel() for parameter in model.parameters())


def write_shards(model: Path, names: tuple[str, ...]) -> None:
    """An index that maps the weights to two shards, of which `names` are written."""
    single = model / "model.safetensors"
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shards[0], "lm_head.weight": shards[1]}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in names:
        shutil.copy(single, model / name)
    single.unlink()


def without_fields(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    del config["intermediate_size"], config["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))


def lfs_pointer(model: Path) -> None:
    (model / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")


def cut_short(model: Path) -> None:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def tokenizer_model_only(model: Path) -> None:
    (model / "tokenizer.json").rename(model / "tokenizer.model")


# Each: files left out of the tiny model, a change to the copy, the lines refused (in order), modules that look
# uninstalled. What each did before is in the comment.
MODEL_DIRS = {
    # OSError: Error no file named model.safetensors ... after tokenizing the data (10 s on the tiny model).
    "no weights": (("model.safetensors",), None, ["has a config.json but no weights (model.safetensors or"], ()),
    # The sentencepiece / tiktoken ValueError of the tokenizer's loading, before the data.
    "no tokenizer": (("tokenizer.json",), None, ["has no tokenizer (tokenizer.json, or vocab.json and merges.txt"], ()),
    # Both of the above: the weights' error came after the tokenizer's.
    "config.json only": (("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"),
                         None, ["has a config.json but no weights", "has no tokenizer"], ()),
    # FileNotFoundError of the missing shard, after tokenizing.
    "index naming a missing shard": ((), lambda model: write_shards(model, ("model-00001-of-00002.safetensors",)),
                                     ["model.safetensors.index.json names 1 of its 2 shard(s) that are not in the "
                                      "directory, first 'model-00002-of-00002.safetensors'"], ()),
    # SafetensorError: header too large / incomplete metadata, after tokenizing.
    "Git LFS pointer": ((), lfs_pointer, ["model.safetensors is a Git LFS pointer, not the weights"], ()),
    "weights cut short": ((), cut_short, ["model.safetensors is not whole safetensors weights"], ()),
    # LlamaConfig's defaults (11008, 32 layers) filled in silently: a shape mismatch when the weights load.
    "config without sizes": ((), without_fields, ["config.json has no intermediate_size, num_hidden_layers"], ()),
    # The sentencepiece ValueError of the tokenizer's loading.
    "SentencePiece tokenizer without sentencepiece": ((), tokenizer_model_only,
                                                      ["reading it needs sentencepiece"], ("sentencepiece",)),
}


@pytest.mark.parametrize("case", MODEL_DIRS)
def test_model_directory_judged_from_its_files(case, tiny_assets, tmp_path, capsys, monkeypatch):
    leave_out, change, expected, uninstalled = MODEL_DIRS[case]
    model = model_copy(tiny_assets, tmp_path, leave_out)
    if change:
        change(model)
    lines, stderr = refused(Case(("--model_name_or_path", str(model)), "", uninstalled=uninstalled),
                            tiny_assets, tmp_path, capsys, monkeypatch)
    assert len(lines) == len(expected), stderr[-2000:]
    for line, message in zip(lines, expected, strict=True):
        assert message in line, stderr[-2000:]


BAD_CONFIGS = {
    # The planner read LlamaConfig's defaults for the missing sizes and planned a 32-layer model.
    "no sizes": (without_fields, "config.json has no intermediate_size, num_hidden_layers: transformers would fill "
                                 "them with its class defaults"),
    # Tracebacks of transformers' ValueError and OSError.
    "an unknown model_type": (lambda model: (model / "config.json").write_text('{"model_type": "nosuch"}'),
                              "has model type `nosuch` but Transformers does not recognize this architecture. "
                              "This could be because of an issue with the checkpoint, or because your version of "
                              "Transformers is out of date. shardtune plans and trains model_type llama, mistral"),
    "a config.json that is not JSON": (lambda model: (model / "config.json").write_text('{"model_type": "llama",'),
                                       "config.json' is not a valid JSON file. Fix it, or use the config.json that "
                                       "came with the model's weights."),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_planner_refuses_a_config_it_cannot_plan(case, tiny_assets, tmp_path, capsys):
    change, message = BAD_CONFIGS[case]
    model = model_copy(tiny_assets, tmp_path)
    change(model)
    assert plan_main(["--model", str(model)]) == 2
    stderr = capsys.readouterr().err
    assert len(stderr.splitlines()) == 1 and message in stderr, stderr[-2000:]


# --- the data -------------------------------------------------------------------------------------------------

ROW = {"prompt": "rev ab=", "completion": "ba"}
CHAT = {"messages": [{"role": "user", "content": "rev ab="}, {"role": "assistant", "content": "ba"}]}


@pytest.fixture
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets[0])


def recipe(path, **overrides) -> Recipe:
    return Recipe(model_name_or_path="tiny", dataset=str(path), max_seq_length=64, eval_fraction=0.25, **overrides)


def lines_of(*rows: dict) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def refused_data(path: Path, content: bytes, tokenizer, message: str, **overrides) -> None:
    path.write_bytes(content)
    with pytest.raises(ConfigError) as refusal:
        load_splits(recipe(path, **overrides), tokenizer)
    assert len(refusal.value.messages) == 1 and message in refusal.value.messages[0], refusal.value.messages


def test_text_that_is_not_utf8_is_named_by_line_and_byte(tmp_path, tokenizer):
    """Before: a UnicodeDecodeError traceback from pyarrow, in the middle of tokenization."""
    head, bad = lines_of(*[ROW] * 5), '{"prompt": "café=", "completion": "x"}\n'.encode("latin-1")
    offset = len(head) + bad.index(b"\xe9")
    refused_data(tmp_path / "latin.jsonl", head + bad + lines_of(*[ROW] * 5), tokenizer,
                 f"is not UTF-8: line 6 (byte {offset}) holds b'\\xe9', which no UTF-8 text holds. Convert the file "
                 "to UTF-8 (from Windows-1252, say: iconv -f cp1252 -t utf-8")
    refused_data(tmp_path / "rows.csv", "prompt,completion\ncafé=,x\n".encode("utf-16"), tokenizer,
                 "is UTF-16 text, not UTF-8: convert it (iconv -f utf-16 -t utf-8")


def test_broken_json_line_is_named_in_our_words(tmp_path, tokenizer, capfd):
    """Before: datasets logged `Failed to load JSON from file ... JSON parse error: Invalid value. in row 10`
    above the refusal."""
    content = lines_of(*[ROW] * 10) + b'{"prompt": "x", "completion": }\n' + lines_of(*[ROW] * 10)
    refused_data(tmp_path / "rows.jsonl", content, tokenizer,
                 "Cannot read dataset '" + str(tmp_path / "rows.jsonl") + "': line 11 is not valid JSON (Expecting "
                 "value, column 31): fix or delete it.")
    assert "Failed to load JSON" not in capfd.readouterr().err
    refused_data(tmp_path / "rows.jsonl", b'"rev ab="\n"ba"\n', tokenizer,
                 "line 1 is a JSON string, not an object: each line must be one object")


def test_rows_of_two_formats_name_the_first_that_differs(tmp_path, tokenizer):
    """Before: `Dataset row 0: messages must be a list of {role, content} objects`, a valid prompt/completion row
    blamed because the messages column of later rows decided the format."""
    content = lines_of(*[ROW] * 10) + b"\n" + lines_of(*[CHAT] * 10)
    refused_data(tmp_path / "rows.jsonl", content, tokenizer,
                 "line 12 is a `messages` row and line 1 a `prompt_completion` row: a source holds rows of one format."
                 " Put each format in a file of its own and give them all, comma-separated")


MISSING = {
    # Each was a tokenization-time `Dataset row 1: prompt and completion must be text`, or not caught at all.
    "a missing key": (lines_of(ROW, {"prompt": "rev ab="}), "rows.jsonl",
                      "line 2 has no `completion` (missing or null), which the `prompt_completion` rows of this "
                      "source need: fill it in or delete the row."),
    "a null": (lines_of(ROW, {"prompt": "rev ab=", "completion": None}), "rows.jsonl", "line 2 has no `completion`"),
    "a number for text": (lines_of(ROW, {"prompt": "rev ab=", "completion": 3}), "rows.jsonl",
                          "line 2 holds 3 in `completion`, which must be text: write it as a string"),
    "an empty cell of a CSV": (b"prompt,completion\nrev ab=,ba\nrev cd=\n", "rows.csv",
                               "row 2 after the header has no `completion`"),
}


@pytest.mark.parametrize("case", MISSING)
def test_a_row_missing_its_field_is_named(case, tmp_path, tokenizer):
    content, name, message = MISSING[case]
    refused_data(tmp_path / name, content, tokenizer, message)


# Llama 3's markers are no tokens of the tiny tokenizer, which finds no assistant turn's end: every token learns.
@pytest.mark.parametrize("template", [{}, {"chat_template": "llama3", "completion_only_loss": False}])
def test_openai_content_parts_train_as_their_joined_text(template, tmp_path, tokenizer):
    """Before: `Dataset row 0: can only concatenate str (not "list") to str` with the tiny model's template, and
    with Llama 3's the list's repr (`[{'type': 'text', ...}]`) trained as the message, silently. Text parts are
    joined as the templates that take parts join them: the same tokens and labels as the chats written as
    strings."""
    chats = [[{"role": "user", "content": f"rev {word}="}, {"role": "assistant", "content": word[::-1]}]
             for word in ("abc", "hij", "defg", "bad", "cafe", "jig", "head", "fig")]
    parted = [[{**message, "content": [{"type": "text", "text": message["content"][:2]},
                                       {"type": "text", "text": message["content"][2:]}]} for message in chat]
              for chat in chats]
    (tmp_path / "strings.jsonl").write_bytes(lines_of(*[{"messages": chat} for chat in chats]))
    (tmp_path / "parts.jsonl").write_bytes(lines_of(*[{"messages": chat} for chat in parted]))
    strings = load_splits(recipe(tmp_path / "strings.jsonl", **template), tokenizer)
    parts = load_splits(recipe(tmp_path / "parts.jsonl", **template), tokenizer)
    for ours, theirs in zip(strings, parts, strict=True):
        assert ours["input_ids"] == theirs["input_ids"] and ours["labels"] == theirs["labels"]


def test_content_parts_that_are_not_text_are_refused(tmp_path, tokenizer):
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                       {"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "a cat"}]}
    refused_data(tmp_path / "rows.jsonl", lines_of(image, image), tokenizer,
                 "a user message's content has a part of type 'image_url' (or one without text): shardtune trains "
                 "text-only models")


@pytest.mark.parametrize("content", [b"\n\n  \n", b"\r\n"])
def test_blank_file_is_empty(content, tmp_path):
    """Before: `Cannot read dataset ...: Instruction "train" corresponds to no data!`, after torch's import."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="is empty; give --dataset a file with training rows"):
        check_dataset_sources(recipe(path))


def test_directory_of_data_files_names_them(tmp_path):
    """A directory of JSON Lines files is no dataset `datasets` saved: the refusal gives its files as a mixture."""
    for name in ("a.jsonl", "b.jsonl", "notes.txt"):
        (tmp_path / name).write_bytes(lines_of(ROW))
    with pytest.raises(ConfigError, match=re.escape(f"It holds 2 data file(s): give them comma-separated, --dataset "
                                                    f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl")):
        check_dataset_sources(recipe(tmp_path))

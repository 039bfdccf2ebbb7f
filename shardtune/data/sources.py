"""What --dataset, --dataset_weights and --chat_template name, checked without loading any data; and the data
files and rows themselves, checked before tokenization: UTF-8 text, JSON that parses, one format per source."""

from __future__ import annotations

import codecs
import json
import os
from typing import TYPE_CHECKING

from shardtune.config import DATA_FILE_TYPES, ConfigError, Recipe
from shardtune.hub import looks_like_path

if TYPE_CHECKING:
    import pyarrow as pa
    from datasets import Dataset

# Bundled chat templates, one `<name>.jinja` each, shipped with the package.
CHAT_TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
# The columns that identify each format, in the order auto-detection tries them. Alpaca's `input` is optional.
FORMATS = {"tokenized": ("input_ids", "labels"), "tokenized_pairs": ("prompt_ids", "chosen_ids", "rejected_ids"),
           "messages": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
           "prompt_completion": ("prompt", "completion"), "text": ("text",), "preference": ("chosen", "rejected")}
TOKENIZED_FORMATS = ("tokenized", "tokenized_pairs")  # used as they are
PREFERENCE_FORMATS = ("preference", "tokenized_pairs")  # pairs, for --method dpo
# The formats whose columns hold text, read as strings when tokenized.
TEXT_FORMATS = ("alpaca", "prompt_completion", "text")
ENCODING_CHUNK = 1 << 20  # bytes decoded at a time: the check reads a file at about 0.6 GB/s


def dataset_sources(dataset: str) -> list[str]:
    """--dataset's sources: one, or several separated by commas (a mixture)."""
    return [source.strip() for source in dataset.split(",")]


def dataset_weights(recipe: Recipe) -> list[float]:
    """The share of each source's rows to take (1.0 = all of it). Raises ConfigError on a bad --dataset_weights."""
    count = len(dataset_sources(recipe.dataset))
    if not recipe.dataset_weights.strip():
        return [1.0] * count
    texts = [text.strip() for text in recipe.dataset_weights.split(",")]
    if len(texts) != count:
        raise ConfigError(f"--dataset_weights gives {len(texts)} weight(s) for {count} --dataset source(s): give one "
                          "share per source, in the same order (e.g. --dataset_weights 1.0,0.5).")
    weights = []
    for text in texts:
        try:
            weight = float(text)
        except ValueError:
            weight = float("nan")
        if not 0.0 < weight <= 1.0:  # also NaN and infinities
            raise ConfigError(f"--dataset_weights {text!r} is not a share of a source's rows: give a number above 0 "
                              "and at most 1 (1.0 = all rows, 0.5 = half).")
        weights.append(weight)
    return weights


def check_dataset_sources(recipe: Recipe) -> None:
    """Every --dataset source (comma-separated) is a usable path or a Hub name."""
    for source in dataset_sources(recipe.dataset):
        if not source:
            raise ConfigError(f"--dataset {recipe.dataset!r} has an empty source between commas: separate the "
                              "sources with single commas.")
        check_dataset_path(source)
        if recipe.dataset_split != "train" and holds_one_split(source):
            raise ConfigError(f"--dataset_split {recipe.dataset_split!r}: {source!r} has one split, loaded whole "
                              "whatever the flag names. Drop --dataset_split, or give a dataset with that split (a "
                              "saved DatasetDict or a Hub dataset).")


def holds_one_split(source: str) -> bool:
    """A data file, or a directory that `save_to_disk` wrote from a single Dataset: either loads whole, as "train"."""
    return os.path.isfile(source) or (os.path.isdir(source)
                                      and not os.path.exists(os.path.join(source, "dataset_dict.json")))


def check_dataset_weights(recipe: Recipe) -> None:
    dataset_weights(recipe)


def check_dataset_num_proc(recipe: Recipe) -> None:
    if recipe.dataset_num_proc is not None and recipe.dataset_num_proc < 1:
        raise ConfigError(f"--dataset_num_proc must be >= 1, got {recipe.dataset_num_proc}; leave it unset for the "
                          "default (up to 8 processes).")


def bundled_chat_templates() -> list[str]:
    """Names of the chat templates shipped in shardtune/data/chat_templates (`<name>.jinja`)."""
    names = os.listdir(CHAT_TEMPLATES_DIR) if os.path.isdir(CHAT_TEMPLATES_DIR) else []
    return sorted(name[: -len(".jinja")] for name in names if name.endswith(".jinja"))


def chat_template_path(value: str) -> str:
    """The Jinja file of --chat_template: a file path, else a bundled name. Raises ConfigError for neither."""
    if os.path.isfile(value):
        return value
    if value in bundled_chat_templates():
        return os.path.join(CHAT_TEMPLATES_DIR, f"{value}.jinja")
    raise ConfigError(f"--chat_template {value!r} is neither a Jinja file nor a bundled template: give a file path "
                      f"or one of {', '.join(bundled_chat_templates())}.")


def check_chat_template(recipe: Recipe) -> None:
    if recipe.chat_template:
        chat_template_path(recipe.chat_template)


def check_dataset_path(dataset: str) -> None:
    """A local file of a known type or a `save_to_disk` directory; anything that does not look like a path is taken
    as a Hub dataset name (checked when it loads)."""
    suffix = os.path.splitext(dataset)[1].lower()
    if os.path.isdir(dataset):
        markers = ("dataset_info.json", "dataset_dict.json")
        if not any(os.path.exists(os.path.join(dataset, marker)) for marker in markers):
            if os.path.isfile(os.path.join(dataset, "config.json")):  # its JSON files are the model's, not data
                raise ConfigError(f"--dataset {dataset!r} is a model directory (it holds config.json): give --dataset "
                                  "the data's file(s), and the model to --model_name_or_path.")
            files = sorted(name for name in os.listdir(dataset)
                           if os.path.splitext(name)[1].lower() in DATA_FILE_TYPES)
            listed = (f" It holds {len(files)} data file(s): give them comma-separated, --dataset "
                      f"{','.join(os.path.join(dataset, name) for name in files[:3])}{',...' * (len(files) > 3)}"
                      if files else "")
            raise ConfigError(f"--dataset {dataset!r} is a directory but not one written by `save_to_disk`; "
                              f"give a data file or a saved dataset.{listed}")
    elif os.path.isfile(dataset):
        if suffix not in DATA_FILE_TYPES:
            raise ConfigError(f"--dataset {dataset!r}: unknown file type {suffix!r}; use one of "
                              f"{', '.join(DATA_FILE_TYPES)} or a `save_to_disk` directory.")
        if os.path.getsize(dataset) == 0 or only_whitespace(dataset):
            raise ConfigError(f"The data file {dataset!r} is empty; give --dataset a file with training rows.")
        if suffix == ".csv":
            check_csv_delimiter(dataset)
    elif looks_like_path(dataset):
        raise ConfigError(f"Dataset file not found: {dataset!r}. Check the path given to --dataset.")


def check_csv_delimiter(path: str) -> None:
    """A .csv file's header is split on commas (datasets' CSV builder, pandas' default): a header with tabs and no
    comma is a tab-separated file, which would load as one column named after the whole header line."""
    with open(path, encoding="utf-8", errors="replace") as file:
        header = next((line for line in file if line.strip()), "").rstrip("\r\n")
    if "\t" in header and "," not in header:
        columns = ", ".join(repr(name) for name in header.split("\t")[:4])
        raise ConfigError(f"The data file {path!r} looks tab-separated (its header holds {columns} between tabs, "
                          "no comma), and a .csv file is read with commas: write it comma-separated (e.g. pandas' "
                          "to_csv), or as JSON Lines (.jsonl).")


def only_whitespace(path: str) -> bool:
    """Blank lines only: read until the first other byte, so a file of rows costs one read."""
    with open(path, "rb") as file:
        while chunk := file.read(ENCODING_CHUNK):
            if chunk.strip():
                return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Data files, read before `datasets` parses them.


def check_text_encoding(path: str) -> None:
    """A JSON or CSV data file must be UTF-8: pyarrow's JSON reader keeps other bytes in its strings, which fail
    only when tokenization reads the row, as a UnicodeDecodeError traceback."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as file:
            while chunk := file.read(ENCODING_CHUNK):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
        return
    except UnicodeDecodeError:
        pass
    with open(path, "rb") as file:
        start = file.read(2)
    name = os.path.basename(path)
    if start in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
        raise ConfigError(f"The data file {path!r} is UTF-16 text, not UTF-8: convert it (iconv -f utf-16 -t utf-8 "
                          f"{name} > utf8-{name}) and give that file.")
    offset = 0
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ConfigError(
                    f"The data file {path!r} is not UTF-8: line {number} (byte {offset + error.start}) holds "
                    f"{line[error.start:error.end]!r}, which no UTF-8 text holds. Convert the file to UTF-8 (from "
                    f"Windows-1252, say: iconv -f cp1252 -t utf-8 {name} > utf8-{name}) and give that file.") from None
            offset += len(line)


def is_json_lines(path: str) -> bool:
    """JSON Lines (one value a line, as .jsonl and most .json data files are), not one JSON document (a list of
    rows, on one line or pretty-printed)."""
    with open(path, encoding="utf-8", errors="replace") as file:
        first = next((line for line in file if line.strip()), "")
    try:
        return not isinstance(json.loads(first), list) or path.lower().endswith(".jsonl")
    except json.JSONDecodeError:
        return path.lower().endswith(".jsonl")


def json_problem(path: str) -> str | None:
    """Where and why a JSON or JSON Lines file does not give rows, in a line (datasets' own errors name neither the
    line nor the cause); None when it finds nothing wrong."""
    if is_json_lines(path):
        with open(path, encoding="utf-8", errors="replace") as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    return f"line {number} is not valid JSON ({error.msg}, column {error.colno}): fix or delete it."
                if not isinstance(row, dict):
                    kind = {str: "string", list: "array", bool: "boolean", type(None): "null"}.get(type(row), "number")
                    return (f"line {number} is a JSON {kind}, not an object: each line must be one "
                            'object of a row\'s fields, e.g. {"text": "..."}.')
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            document = json.load(file)
    except json.JSONDecodeError as error:
        return f"line {error.lineno} column {error.colno} is not valid JSON ({error.msg})."
    if not isinstance(document, list) or not all(isinstance(row, dict) for row in document):
        return ("it is one JSON document but not a list of row objects: give JSON Lines (one object a line) or a "
                "JSON list of objects.")
    return None if document else "it holds no rows."


def row_place(source: str, index: int) -> str:
    """Where row `index` (0-based, as loaded) is: its line in a JSON Lines file (datasets skips blank lines),
    else its 1-based row number."""
    if os.path.isfile(source) and source.lower().endswith((".json", ".jsonl")) and is_json_lines(source):
        with open(source, "rb") as file:
            rows = (number for number, line in enumerate(file, start=1) if line.strip())
            line = next((number for position, number in enumerate(rows) if position == index), None)
        if line is not None:
            return f"line {line}"
    return f"row {index + 1}{' after the header' * source.lower().endswith('.csv')}"


# ---------------------------------------------------------------------------------------------------------------
# Rows, read by column in Arrow before tokenization.


def detect_format(columns: list[str], requested: str = "auto") -> str:
    """The format of a source's columns: rows tokenized before are used as they are; otherwise --dataset_format,
    or the first format whose columns the source has."""
    for tokenized in TOKENIZED_FORMATS:
        if all(column in columns for column in FORMATS[tokenized]):
            return tokenized
    if requested != "auto":
        missing = [column for column in FORMATS[requested] if column not in columns]
        if missing:
            raise ConfigError(f"--dataset_format {requested} needs column(s) {missing}; the dataset has "
                              f"{sorted(columns)}.")
        return requested
    for name, needed in FORMATS.items():
        if all(column in columns for column in needed):
            return name
    raise ConfigError(
        f"Dataset columns {sorted(columns)} match no known format{misspelt_columns(columns)}: give `messages` "
        "(chat), `conversations` (ShareGPT), `instruction` and `output` (Alpaca), `prompt` and `completion`, "
        "`text`, or `chosen` and `rejected` (preference pairs, with or without `prompt`: --method dpo)."
    )


def misspelt_columns(columns: list[str]) -> str:
    """The columns that look like a misspelt format column (`rejectd`), as a parenthesis of the refusal."""
    import difflib

    known = list(dict.fromkeys(column for needed in FORMATS.values() for column in needed))
    unknown = [column for column in columns if column not in known]
    guesses = [f"`{found[0]}`: did you mean `{column}`?" for column in known if column not in columns
               and (found := difflib.get_close_matches(column, unknown, n=1, cutoff=0.8))]
    return f" ({' '.join(guesses)})" if guesses else ""


def source_format(raw: Dataset, requested: str = "auto") -> str:
    """A source's format: detect_format's, except that auto-detection takes the first format whose columns the
    first row fills (a column of another format may hold only nulls). check_row_formats holds every row to it."""
    data_format = detect_format(raw.column_names, requested)
    if data_format in TOKENIZED_FORMATS or requested != "auto" or len(raw) == 0:
        return data_format
    return (row_formats(raw, 0) or [data_format])[0]


def filled(raw: Dataset, columns: tuple[str, ...]) -> pa.ChunkedArray:
    """Arrow mask over the rows as loaded: those that hold a value (not null, not missing) in every one of
    `columns`, which the source has (detect_format made sure)."""
    import pyarrow.compute as pc

    mask = pc.is_valid(raw.data.column(columns[0]))
    for column in columns[1:]:
        mask = pc.and_(mask, pc.is_valid(raw.data.column(column)))
    return mask


def row_formats(raw: Dataset, index: int) -> list[str]:
    """The formats whose columns row `index` fills, in detection order."""
    row = raw[index]
    return [name for name, needed in FORMATS.items()
            if name not in TOKENIZED_FORMATS and all(row.get(column) is not None for column in needed)]


def check_row_formats(raw: Dataset, requested: str, source: str) -> str:
    """Every row of a source, as loaded (row i is the source's i-th), in one format, the first row's (or
    --dataset_format's), with its columns filled, and text where the format reads text: the first row that is not
    is named by its line, before tokenization (which would blame a valid row, or fail on a null). Returns the
    format."""
    import pyarrow.compute as pc

    if len(raw) == 0:
        raise ConfigError(f"{source!r} holds no rows: give --dataset a source with training rows.")
    data_format = source_format(raw, requested)
    if data_format in TOKENIZED_FORMATS:
        return data_format
    needed = FORMATS[data_format]
    lacking = pc.invert(filled(raw, needed))
    if pc.any(lacking).as_py():
        index = pc.index(lacking, True).as_py()
        place, theirs = row_place(source, index), row_formats(raw, index)
        if theirs and requested == "auto":
            raise ConfigError(f"{source!r}: {place} is a `{theirs[0]}` row and {row_place(source, 0)} a "
                              f"`{data_format}` row: a source holds rows of one format. Put each format in a file of "
                              "its own and give them all, comma-separated (--dataset a.jsonl,b.jsonl).")
        empty = [f"`{column}`" for column in needed if raw[index].get(column) is None]
        why = (f"--dataset_format {requested} needs" if requested != "auto"
               else f"the `{data_format}` rows of this source need")
        raise ConfigError(f"{source!r}: {place} has no {' or '.join(empty)} (missing or null), which {why}: fill it "
                          "in or delete the row.")
    if data_format in TEXT_FORMATS:
        for column in [*needed, *(["input"] if data_format == "alpaca" and "input" in raw.column_names else [])]:
            check_text_column(raw, column, source, optional=column == "input")
    return data_format


def check_text_column(raw: Dataset, column: str, source: str, optional: bool = False) -> None:
    """A column read as text holds strings (a number or a list in one row makes `datasets` store it as JSON)."""
    feature = raw.features[column]
    if getattr(feature, "dtype", None) in ("string", "large_string"):
        return
    for index, value in enumerate(raw[column]):
        if not isinstance(value, str) and not (optional and value is None):
            raise ConfigError(f"{source!r}: {row_place(source, index)} holds {json.dumps(value)[:40]} in "
                              f"`{column}`, which must be text: write it as a string (\"{column}\": \"...\").")


def row_error(index: int, source: str, error: Exception) -> ConfigError:
    return ConfigError(f"Dataset row {index}: {error} (in {source!r}).")


def joined_parts(messages: list[dict]) -> list[dict]:
    """OpenAI's content as a list of parts (`[{"type": "text", "text": "..."}]`) as the string every template
    renders: the texts joined as they are, as the templates that take parts join them (Gemma 3's, TRL's vision
    ones; Llama 3's would render the list's repr). A part that is not text is refused: these models read text."""
    if not isinstance(messages, list):
        return messages  # check_chat names it
    joined = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"a {message.get('role')} message's content has a part of type {kind!r} (or "
                                     "one without text): shardtune trains text-only models; keep only "
                                     '{"type": "text", "text": "..."} parts, or give the content as a string')
            message = {**message, "content": "".join(part["text"] for part in content)}
        joined.append(message)
    return joined

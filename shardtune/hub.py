"""Local path or Hugging Face Hub id: how a model or dataset name is told apart, and what to say when the Hub
cannot supply a model."""

from __future__ import annotations

import os
import re

import huggingface_hub.constants
from huggingface_hub import errors
from huggingface_hub.constants import is_offline_mode
from huggingface_hub.utils import HFValidationError, validate_repo_id

# Seconds one probe of the Hub may take. huggingface_hub retries a failed lookup of a file not in the cache five
# times with back-off (about 25 s) before giving up: the probe decides once, without retries.
HUB_PROBE_TIMEOUT = 5.0
# Set when a probe found the Hub out of reach (and huggingface_hub was put offline): the refusal then says so.
_unreachable: list[str] = []


def looks_like_path(name: str) -> bool:
    """A name that has a file extension (`train.jsonl`, not `Qwen2.5-7B`'s `.5-7B`) or cannot be a Hub repo id
    (`./x`, `/x`, `~/x`, `a/b/c`, `data/`): what exists nowhere locally is then "not found", not a Hub name."""
    if re.fullmatch(r"\.[A-Za-z][A-Za-z0-9]*", os.path.splitext(name)[1]):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def is_hub_id(name: str) -> bool:
    """A name that can be a Hub model id as users give them: `owner/name` (a bare name is one of the Hub's few
    un-namespaced legacy models, none of them Llama-class, or a mistyped built-in or path)."""
    return "/" in name.strip("/") and not looks_like_path(name)


def probe_hub() -> None:
    """Put huggingface_hub offline when its endpoint does not answer one request within HUB_PROBE_TIMEOUT (no
    retries), so that a lookup of a model id fails at once, from the cache, instead of after its retries; a cached
    config.json is still read. Probes once a process; HF_HUB_OFFLINE=1 already set skips it."""
    if is_offline_mode() or _unreachable:
        return
    from huggingface_hub.utils import get_session

    try:
        get_session().head(huggingface_hub.constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT)
    except Exception as error:  # any failure to get an answer: DNS, refused connection, proxy, timeout
        _unreachable.append(first_line(error))
        huggingface_hub.constants.HF_HUB_OFFLINE = True


def hub_problem(name: str, error: OSError) -> str:
    """Why a name that is no local directory could not be had from the Hub, and what to do, from the
    huggingface_hub error that transformers wraps in OSError."""
    cause = error.__cause__
    if isinstance(cause, errors.GatedRepoError):
        return (f"{name!r} is a gated Hub model: accept its license at https://huggingface.co/{name}, then run "
                "`hf auth login` (or set HF_TOKEN), or give a local model directory.")
    if isinstance(cause, errors.RepositoryNotFoundError):
        return (f"{name!r} is neither a local directory nor a Hub model id (if it is private, run "
                "`hf auth login`): check --model_name_or_path.")
    if _unreachable:
        return (f"Cannot reach the Hugging Face Hub ({huggingface_hub.constants.ENDPOINT}: {_unreachable[0]}) for "
                f"{name!r}, which is neither a local directory nor in the Hugging Face cache: check the network or "
                "proxy, or give a local model directory.")
    if is_offline_mode():
        return (f"{name!r} is not a local directory and not in the Hugging Face cache, and HF_HUB_OFFLINE=1 keeps "
                "the Hub out of reach: set HF_HUB_OFFLINE=0 where there is network (`hf auth login` for a "
                "gated model), or give a local model directory.")
    return (f"Cannot reach the Hugging Face Hub for {name!r} (no local directory of that name, not in the cache): "
            "check the network or proxy, run `hf auth login` for a gated model, or give a local model "
            f"directory. ({first_line(error)})")


def first_line(error: BaseException) -> str:
    """An error's first line (its type's name when it has no text): one line of a refusal."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


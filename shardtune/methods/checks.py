"""--method dpo's checks that need no weights and no data read: its values as TRL's DPOConfig takes them, its flags
only with it, the SFT flags it would ignore, the launches it is not wired for, and the reference model against the
policy's. checks.startup runs them with the others; like them, this module imports no torch (a bad command line
is refused before the heavy imports)."""

from __future__ import annotations

import json
import os

from shardtune.config import DPO_LOSS_TYPES, ConfigError, Recipe
from shardtune.flags import set_fields

# The Recipe fields that act only under --method dpo.
DPO_FIELDS = ("beta", "loss_type", "loss_weights", "label_smoothing", "precompute_ref_log_probs",
              "ref_model_name_or_path")
# The losses whose formula reads --label_smoothing (TRL 1.16's DPOTrainer._compute_loss: robust and exo_pair, and
# the aot losses shardtune does not take); every other loss computes the same with any value.
SMOOTHED_LOSSES = ("robust", "exo_pair")


def check_dpo_values(recipe: Recipe) -> None:
    """--beta, --loss_type, --loss_weights and --label_smoothing under --method dpo, each problem one line, as TRL's
    DPOConfig and DPOTrainer refuse them, and --label_smoothing where no --loss_type reads it (TRL would train as
    with 0). Without --method dpo check_dpo_flags refuses them all."""
    if recipe.method != "dpo":
        return
    problems = []
    if not recipe.beta > 0:  # also NaN
        problems.append(f"--beta must be > 0, got {recipe.beta}: it weighs the policy's distance from the reference "
                        "(TRL's default is 0.1).")
    unknown = [name for name in recipe.loss_type if name not in DPO_LOSS_TYPES]
    if unknown or not recipe.loss_type:
        problems.append(f"--loss_type {' '.join(recipe.loss_type) or '(none)'}: {', '.join(unknown) or 'none given'} "
                        f"is not a DPO loss; choose among {', '.join(DPO_LOSS_TYPES)}.")
    if len(set(recipe.loss_type)) != len(recipe.loss_type):
        problems.append(f"--loss_type {' '.join(recipe.loss_type)} names a loss twice: give each once, weighted by "
                        "--loss_weights.")
    if recipe.loss_weights is not None and len(recipe.loss_weights) != len(recipe.loss_type):
        problems.append(f"--loss_weights has {len(recipe.loss_weights)} value(s) for {len(recipe.loss_type)} "
                        "--loss_type value(s): give one weight per loss, in the same order.")
    if "robust" in recipe.loss_type and not 0 <= recipe.label_smoothing < 0.5:
        problems.append(f"--label_smoothing {recipe.label_smoothing} with the robust loss: it must lie in [0, 0.5).")
    elif "exo_pair" in recipe.loss_type and not 0 < recipe.label_smoothing < 1:
        problems.append(f"--label_smoothing {recipe.label_smoothing} with the exo_pair loss: it must lie in (0, 1) "
                        "(TRL suggests 1e-3).")
    elif not 0 <= recipe.label_smoothing < 1:
        problems.append(f"--label_smoothing must lie in [0, 1), got {recipe.label_smoothing}.")
    elif recipe.label_smoothing and not set(SMOOTHED_LOSSES) & set(recipe.loss_type):
        problems.append(f"--label_smoothing {recipe.label_smoothing} would be ignored: --loss_type "
                        f"{' '.join(recipe.loss_type)} does not use it, only {' and '.join(SMOOTHED_LOSSES)} do: add "
                        "one of them to --loss_type, or drop --label_smoothing.")
    if problems:
        raise ConfigError(problems)


def check_dpo_flags(recipe: Recipe, given: frozenset[str] = frozenset()) -> None:
    """DPO's flags only with --method dpo: without it they would be accepted and ignored (a flag given at its
    default counts: `given`, the fields on the command line). Under DPO, the SFT settings it would ignore."""
    if recipe.method != "dpo":
        named = [f"--{name}" for name in set_fields(recipe, DPO_FIELDS, given)]
        if named:
            raise ConfigError(f"{', '.join(named)} configure{'s' if len(named) == 1 else ''} DPO, which runs only "
                              f"with --method dpo: add it, or drop {'it' if len(named) == 1 else 'them'}.")
        return
    problems = []
    if recipe.packing:  # TRL 1.16's DPOConfig refuses padding_free too
        problems.append("--packing with --method dpo: a pair's chosen and rejected sequences run as one padded "
                        "batch, as TRL's DPOTrainer runs them (it refuses padding-free DPO): drop --packing.")
    if recipe.truncation == "drop":
        problems.append("--truncation drop with --method dpo: DPO cuts each sequence to --max_seq_length keeping its "
                        "start, as TRL does, and drops only the pairs that then teach nothing: drop --truncation.")
    if not recipe.completion_only_loss:
        problems.append("--completion_only_loss false with --method dpo: DPO's loss is over the chosen and rejected "
                        "completions, never the prompt: drop it.")
    # DPO's log-probs multiply by the head's weight itself, in tiles or whole (shardtune.methods.dpo).
    if recipe.use_peft and "lm_head" in [name.strip() for name in recipe.lora_target_modules.split(",")]:
        problems.append("--lora_target_modules lm_head with --method dpo: DPO's log-probs multiply by the LM head's "
                        "weight itself, which bypasses an adapter on it: target other layers (e.g. all-linear).")
    if problems:
        raise ConfigError(problems)


def check_dpo_launch(recipe: Recipe, sp_size: int) -> None:
    """The launches DPO's step is not wired for: the sequence split slices each micro-batch's positions over ranks,
    and DPO's sequence log-probs are summed over whole sequences."""
    if recipe.method == "dpo" and sp_size > 1:
        raise ConfigError(f"--method dpo under the sequence split (sp_size {sp_size} in the accelerate config): the "
                          "split is not wired for DPO; launch with a config without sequence parallelism.")


def check_reference_model(recipe: Recipe) -> None:
    """--ref_model_name_or_path as --model_name_or_path is judged (shardtune.checks.model): a model that can be
    had, of a supported family, a local directory with whole weights; and the policy's vocabulary, since the
    reference scores the policy's token ids. The policy's own problems are check_model's to report."""
    path = recipe.ref_model_name_or_path
    if recipe.method != "dpo" or not path:
        return
    from shardtune.checks.model import check_weights
    from shardtune.hub import is_hub_id, probe_hub
    from shardtune.models.flops import ModelError, read_config

    try:
        if is_hub_id(path) and not os.path.isdir(path):
            probe_hub()  # out of reach: the lookup fails at once, not after huggingface_hub's retries
        config = read_config(path)
        if os.path.isdir(path):  # a Hub id's files are fetched, and judged, when it loads
            check_weights(path, config)
    except (ModelError, ConfigError) as error:  # their messages name the policy's flag
        raise ConfigError(str(error).replace("--model_name_or_path", "--ref_model_name_or_path")) from None
    try:
        policy = read_config(recipe.model_name_or_path)
    except ModelError:
        return
    if config.vocab_size != policy.vocab_size:
        raise ConfigError(f"--ref_model_name_or_path {path!r} has a vocabulary of {config.vocab_size} tokens and "
                          f"the policy {policy.vocab_size}: the reference scores the policy's token ids, so it must "
                          "share its tokenizer; give a reference of the policy's family and tokenizer.")
    theirs = vocabulary(path)
    mine = vocabulary(recipe.model_name_or_path) if theirs is not None else None
    if theirs is not None and mine is not None and theirs != mine:
        raise ConfigError(f"--ref_model_name_or_path {path!r} has another tokenizer than the policy (their "
                          "tokenizer.json vocabularies differ): the reference would score the policy's token ids as "
                          "other tokens; give a reference that shares the policy's tokenizer.")


def vocabulary(path: str) -> dict | None:
    """A local model's tokens and their ids (tokenizer.json's vocabulary and added tokens), or None where it has
    no tokenizer.json (a reference needs none: it reads the policy's tokens)."""
    name = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(name):
        return None
    with open(name, encoding="utf-8") as file:
        tokenizer = json.load(file)
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # a Unigram (SentencePiece) model: [piece, score] in id order
        vocab = {piece[0]: index for index, piece in enumerate(vocab)}
    return {**vocab, **{token["content"]: token["id"] for token in tokenizer.get("added_tokens") or []}}

"""The accelerate config file itself: every key accelerate would not read (an unknown top-level key, which
accelerate refuses only when it launches; a misspelt key of a section, which it ignores), named with the nearest
key it reads, before anything launches."""

from __future__ import annotations

import difflib

# The sections whose keys `accelerate launch` copies onto its own arguments with a prefix (commands/launch.py,
# _validate_launch_command): fsdp_config's `offload_params` is its --fsdp_offload_params.
SECTION_PREFIXES = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}
# Top-level keys accelerate still reads and converts (BaseConfig.process_config).
LEGACY_KEYS = ("fp16", "dynamo_backend")
# Keys of a DeepSpeed JSON config, which accelerate reads only through an accelerate config's
# deepspeed_config_file: a file that sets them at its top is that JSON given in the YAML's place.
DEEPSPEED_JSON_KEYS = frozenset({"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_clipping", "optimizer", "scheduler", "bf16", "wall_clock_breakdown"})


def accelerate_config_keys(compute_environment: str) -> tuple[frozenset[str], frozenset[str]]:
    """(the top-level keys, the keys of its sections) of an accelerate config file, as accelerate reads them: the
    fields of the config class it loads the file into (ClusterConfig on a local machine), and the arguments of
    `accelerate launch`, onto which it copies every key of a section (fsdp_config, deepspeed_config, ...). It
    copies an unknown key just the same, where nothing reads it: a misspelt key is silently ignored."""
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig
    from accelerate.commands.launch import launch_command_parser

    config_class = ClusterConfig if compute_environment == "LOCAL_MACHINE" else SageMakerConfig
    fields = frozenset(item.name for item in dataclasses.fields(config_class)) | frozenset(LEGACY_KEYS)
    arguments = frozenset(action.dest for action in launch_command_parser()._actions)
    return fields, arguments


def accelerate_config_problems(path: str) -> list[str]:
    """One line per key of the accelerate config file at `path` that accelerate would not read (accelerate refuses
    an unknown top-level key only when it launches, and ignores an unknown key of a section), naming the nearest
    key it reads. [] for a file it cannot read (its launcher says why)."""
    import yaml

    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as error:
        return [f"Cannot read the accelerate config {path}: {' '.join(str(error).split())}"]
    if not isinstance(config, dict):
        return [f"The accelerate config {path} is not a mapping of keys to values: write it as `accelerate config` "
                "does (accelerate_configs/*.yaml are examples)."]
    deepspeed_keys = sorted(DEEPSPEED_JSON_KEYS & set(map(str, config)))
    if deepspeed_keys and "distributed_type" not in config:  # every key would be refused, none with the cause
        return [f"{path} is a DeepSpeed config (it sets {', '.join(deepspeed_keys)}), not an accelerate config: give "
                "the accelerate YAML that names it as deepspeed_config_file (as accelerate_configs/ds_zero3.yaml "
                "names deepspeed/zero3.json)."]
    fields, arguments = accelerate_config_keys(str(config.get("compute_environment", "LOCAL_MACHINE")))
    problems = [unknown_key(path, str(key), None, sorted(fields)) for key in config if str(key) not in fields]
    for section, values in config.items():
        if not (str(section).endswith("_config") and isinstance(values, dict)):
            continue
        prefix = SECTION_PREFIXES.get(section, "")
        for key in map(str, values):
            read_as = key if key.startswith(prefix) else prefix + key
            if read_as not in arguments:
                # The nearest among the keys written in this section: those sharing its prefix, or for
                # deepspeed_config (whose keys have none) every argument of the launcher.
                candidates = sorted(name for name in arguments if name.startswith(prefix) or not prefix)
                problems.append(unknown_key(path, key, str(section), candidates))
    return problems


def unknown_key(path: str, key: str, section: str | None, candidates: list[str]) -> str:
    """The line for a key accelerate does not read, with the nearest it does."""
    nearest = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    fix = f"did you mean {nearest[0]}?" if nearest else "remove it (see `accelerate launch --help` for the keys)."
    if section is None:  # accelerate launch refuses these itself, without a hint
        return f"The accelerate config {path} sets {key!r}, which accelerate does not know: {fix}"
    return (f"The accelerate config {path} sets {section}: {key!r}, which accelerate does not read (it would be "
            f"ignored): {fix}")

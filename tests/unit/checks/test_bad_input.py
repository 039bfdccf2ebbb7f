"""Bad configuration stops with one clear line and exit code 2, before any model is loaded or file written."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub.constants
import pytest

from shardtune.cli import main
from shardtune.config import Recipe
from tests.conftest import overridden


@dataclass(frozen=True)
class Case:
    """Flags (`{tmp}` is the test's directory), launch variables, files written under {tmp} first, modules made
    to look uninstalled, whether the Hub is out of reach (HF_HUB_OFFLINE=1), and what the one error line must
    say."""

    args: tuple[str, ...]
    message: str
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    uninstalled: tuple[str, ...] = ()
    offline: bool = False


MULTI_NODE = {"WORLD_SIZE": "2", "RANK": "0"}
RENDEZVOUS = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
DEEPSPEED = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
        "FSDP_SHARDING_STRATEGY": "FULL_SHARD"}
EARLIER_RUN = {"out/metrics.jsonl": '{"step": 1, "loss": 2.5}\n', "out/checkpoint-1/checkpoint_complete.json":
               '{"step": 1, "world_size": 1}'}

CASES = {
    # Recipe fields and command-line flags.
    "no GPU and no CPU mode": Case(("--use_cpu", "false"), "No CUDA GPU is visible"),
    "unknown attention": Case(("--attn_implementation", "flash"), "--attn_implementation 'flash' is unknown"),
    "flex attention on CPU": Case(("--attn_implementation", "flex_attention"), "no backward pass on CPU"),
    "unknown flag": Case(("--learning_rat", "1e-4"),
                         "Unknown argument --learning_rat: did you mean --learning_rate?"),
    "unknown flag with =": Case(("--per_device_batch_size=8",),
                                "Unknown argument --per_device_batch_size: shardtune calls it "
                                "--per_device_train_batch_size."),
    "stray value": Case(("stray",), "Unexpected value 'stray' on the command line"),
    "bf16 and fp16": Case(("--bf16", "true", "--fp16", "true"), "--bf16 true --fp16 true ask for two precisions"),
    "bf16 against mixed_precision": Case(("--mixed_precision", "no", "--bf16"),
                                         "--bf16 true asks for bf16, --mixed_precision for no"),
    "fp8 without float8 tensor cores": Case(("--mixed_precision", "fp8"),
                                            "--mixed_precision fp8 runs float8 matmuls on CUDA GPUs of compute "
                                            "capability 8.9 or more (H100, H200, L4, L40S): on this machine use "
                                            "--mixed_precision bf16."),
    "warm-up in steps and as a ratio": Case(("--warmup_steps", "10", "--warmup_ratio", "0.1"),
                                            "--warmup_steps 10 and --warmup_ratio 0.1 both set the warm-up"),
    "negative warm-up steps": Case(("--warmup_steps", "-1"), "--warmup_steps must be >= 0, got -1"),
    "reentrant checkpointing": Case(("--gradient_checkpointing_kwargs", '{"use_reentrant": true}'),
                                    "use_reentrant true is not supported: the trainer recomputes with "
                                    "use_reentrant=False"),
    "checkpointing kwargs that do not map": Case(("--gradient_checkpointing_kwargs", '{"preserve_rng_state": false}'),
                                                 "preserve_rng_state: only use_reentrant (false) maps"),
    "checkpointing kwargs not JSON": Case(("--gradient_checkpointing_kwargs", "use_reentrant=False"),
                                          "'use_reentrant=False' is not a JSON object"),
    "batch does not divide": Case(("--global_batch_size", "33", "--per_device_train_batch_size", "4"),
                                  "--global_batch_size 33 is not divisible"),
    "accumulation disagrees": Case(("--global_batch_size", "32", "--per_device_train_batch_size", "4",
                                    "--gradient_accumulation_steps", "4"), "disagrees with --global_batch_size"),
    "fp16 without a loss scaler": Case(("--mixed_precision", "fp16"), "needs a loss scaler"),
    "unknown precision": Case(("--mixed_precision", "fp4"), "--mixed_precision must be one of"),
    "4-bit without LoRA": Case(("--load_in_4bit", "true"), "add --use_peft true"),
    "QLoRA without a GPU": Case(("--use_peft", "true", "--load_in_4bit", "true"), "--load_in_4bit needs a CUDA GPU"),
    "Liger without a GPU": Case(("--use_liger_kernel", "true"),
                                "--use_liger_kernel runs Liger's Triton kernels, which need a CUDA GPU"),
    "Liger over the full logits": Case(("--use_liger_kernel", "true", "--chunked_cross_entropy", "false"),
                                       "and --chunked_cross_entropy false asks for the full logits"),
    "unknown data format": Case(("--dataset_format", "xml"), "--dataset_format must be one of"),
    "negative generation samples": Case(("--generation_samples", "-1"), "--generation_samples must be 0 (off)"),
    "unknown export dtype": Case(("--save_dtype", "float8"), "--save_dtype 'float8' is not one of auto, bf16"),
    "zero learning rate": Case(("--learning_rate", "0"), "--learning_rate must be > 0, got 0.0"),
    "negative learning rate": Case(("--learning_rate", "-0.0001"), "--learning_rate must be > 0, got -0.0001"),
    "max_seq_length 0": Case(("--max_seq_length", "0"), "--max_seq_length must be >= 2, got 0"),
    "not a boolean": Case(("--packing", "maybe"), "Bad command line: argument --packing: Truthy value expected"),
    "TRL's wrapped packing": Case(("--packing", "true", "--packing_strategy", "wrapped"),
                                  "--packing_strategy must be one of padding_free, bfd; got 'wrapped'"),
    "bfd without packing": Case(("--packing_strategy", "bfd"), "--packing_strategy bfd packs sequences into rows "
                                "only with --packing true: add --packing true"),
    "not a number": Case(("--max_steps", "ten"), "invalid int value: 'ten'"),
    "LoRA rank 0": Case(("--use_peft", "true", "--lora_r", "0"), "LoRA needs --lora_r >= 1"),
    "LoRA rank without LoRA": Case(("--lora_r", "8"), "--lora_r shapes LoRA adapters, which train only with "
                                   "--use_peft true"),
    "LoRA targets without LoRA": Case(("--lora_target_modules", "q_proj", "--lora_alpha", "8"),
                                      "--lora_alpha, --lora_target_modules shape LoRA adapters"),
    "a config file outside dry run": Case(("--config_file", "accelerate_configs/ds_zero3.yaml"),
                                          "to train under it, give it to the launcher: accelerate launch "
                                          "--config_file accelerate_configs/ds_zero3.yaml"),
    "a GPU name that is a typo": Case(("--hardware", "8xh10-80gb"), "Unknown GPU 'h10'"),
    "unknown scheduler": Case(("--lr_scheduler_type", "cosine_decay"), "--lr_scheduler_type must be one of"),
    "scheduler needing arguments": Case(("--lr_scheduler_type", "warmup_stable_decay"),
                                        "--lr_scheduler_type must be one of"),
    "negative clipping norm": Case(("--max_grad_norm", "-1"), "--max_grad_norm must be >= 0, got -1.0: 0 clips"),
    "beta2 of 1": Case(("--adam_beta2", "1"), "--adam_beta2 must be in [0, 1), got 1.0"),
    "negative epsilon": Case(("--adam_epsilon=-1e-8",), "--adam_epsilon must be >= 0, got -1e-08"),
    "warm-up on a constant schedule": Case(("--lr_scheduler_type", "constant", "--warmup_ratio", "0.1"),
                                           "constant has no warm-up"),
    "schedule arguments it does not take": Case(("--lr_scheduler_kwargs", '{"cycles": 2}'),
                                                "--lr_scheduler_kwargs cycles: --lr_scheduler_type cosine takes "
                                                "num_cycles"),
    "packing one row": Case(("--packing", "true", "--per_device_train_batch_size", "1"), "packs nothing"),
    "resume and overwrite": Case(("--resume_from_checkpoint", "{tmp}", "--overwrite_output_dir", "true"),
                                 "--overwrite_output_dir true would be ignored: a run resumed from"),
    "eval_fraction beside eval_split": Case(("--eval_split", "test", "--eval_fraction", "0.1"),
                                            "--eval_fraction would be ignored: --eval_split holds out"),
    "run name without a tracker": Case(("--report_to", "none", "--run_name", "x"),
                                       "--run_name would be ignored: --report_to none"),
    "eval_fraction over 1": Case(("--eval_fraction", "1.5"), "--eval_fraction must be between 0 and 1"),
    "negative save_total_limit": Case(("--save_total_limit", "-1"), "--save_total_limit must be >= 0, got -1"),
    "zero rank timeout": Case(("--rank_timeout_s", "0"), "--rank_timeout_s must be > 0, got 0.0"),
    "resume from a missing checkpoint": Case(("--resume_from_checkpoint", "{tmp}/out/checkpoint-9"),
                                             "/out/checkpoint-9' is not a directory"),
    "output_dir of an earlier run": Case((), "already holds files of another run", files=EARLIER_RUN),
    "output_dir is a file": Case((), "is a file; give a directory", files={"out": "not a directory"}),
    # The launch environment, as `accelerate launch` exports it from the config file and its flags.
    "multi-node without MASTER_ADDR": Case((), "MASTER_ADDR is not set", env={**MULTI_NODE, "MASTER_PORT": "29500"}),
    "multi-node without a rendezvous": Case((), "MASTER_ADDR and MASTER_PORT are not set", env=MULTI_NODE),
    "RANK not below WORLD_SIZE": Case((), "RANK 2 does not fit WORLD_SIZE 2",
                                      env={**MULTI_NODE, **RENDEZVOUS, "RANK": "2"}),
    "WORLD_SIZE not a number": Case((), "WORLD_SIZE='two' is not a whole number", env={"WORLD_SIZE": "two"}),
    "NVMe offload without a path": Case((), "offloads the optimizer and param states to NVMe: pass --offload_nvme_path",
                                        env={**DEEPSPEED, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme",
                                             "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}),
    "NVMe path without NVMe offload": Case(("--offload_nvme_path", "{tmp}"), "is used only with NVMe offload",
                                           env=DEEPSPEED),
    "ZeRO stage 4": Case((), "sets zero_stage '4'", env={**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "4"}),
    "parameter offload below ZeRO-3": Case((), "offload_param_device cpu needs ZeRO stage 3", env={
        **DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"}),
    "NVMe optimizer offload below ZeRO-3": Case((), "offload_optimizer_device nvme needs ZeRO stage 3", env={
        **DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme"}),
    "DeepSpeed not installed": Case((), "pip install deepspeed", env=DEEPSPEED, uninstalled=("deepspeed",)),
    "async save of a full state dict": Case(("--async_save", "true"),
                                            "config sets fsdp_state_dict_type FULL_STATE_DICT",
                                            env={**FSDP, "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}),
    "FSDP version 1": Case((), "set fsdp_version: 2", env={**FSDP, "FSDP_VERSION": "1"}),
    "FSDP1 strategy as reshard_after_forward": Case((), "'HYBRID_SHARD' is an FSDP1 strategy",
                                                    env={**FSDP, "FSDP_RESHARD_AFTER_FORWARD": "HYBRID_SHARD"}),
    "FSDP1 sharding_strategy under FSDP2": Case((), "fsdp_sharding_strategy SHARD_GRAD_OP is an FSDP1 setting",
                                                env={**FSDP, "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}),
    "W&B without wandb": Case(("--report_to", "wandb"), "pip install wandb, or pass --report_to none",
                              uninstalled=("wandb",)),
    # The model, from its config.json alone (no weights).
    "missing model directory": Case(("--model_name_or_path", "{tmp}/models/llama"),
                                    "Model directory not found: '"),
    "model directory without config.json": Case(("--model_name_or_path", "{tmp}/weights"),
                                                "is a directory without config.json",
                                                files={"weights/model.safetensors": "not a model"}),
    "Hub id out of reach offline": Case(("--model_name_or_path", "shardtune-tests/no-such-model"),
                                        "HF_HUB_OFFLINE=1 keeps the Hub out of reach: set HF_HUB_OFFLINE=0",
                                        offline=True),
    "max_seq_length above the model's": Case(("--max_seq_length", "100000000"),
                                             "--max_seq_length 100000000 is above the model's "
                                             "max_position_embeddings 256: give --max_seq_length 256 or less"),
    "unknown LoRA target": Case(("--use_peft", "true", "--lora_target_modules", "q_proj,v_prj"),
                                "--lora_target_modules 'v_prj' names no layer of the model: its linear modules are "
                                "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    # Data files, as far as they can be judged without reading them.
    "missing dataset": Case(("--dataset", "no/such/file.jsonl"), "Dataset file not found: 'no/such/file.jsonl'"),
    "missing file of an unknown type": Case(("--dataset", "notes.txt"), "Dataset file not found: 'notes.txt'"),
    "missing directory": Case(("--dataset", "rows/"), "Dataset file not found: 'rows/'"),
    "missing source of a mixture": Case(("--dataset", "{tmp}/train.jsonl,extra/rows.parquet"),
                                        "Dataset file not found: 'extra/rows.parquet'",
                                        files={"train.jsonl": '{"text": "rev ab=ba"}\n'}),
    "empty data file": Case(("--dataset", "{tmp}/train.jsonl"), "train.jsonl' is empty", files={"train.jsonl": ""}),
    "unsupported file type": Case(("--dataset", "{tmp}/train.txt"), "unknown file type '.txt'",
                                  files={"train.txt": "rev ab=ba\n"}),
    "directory not from save_to_disk": Case(("--dataset", "{tmp}/rows"), "not one written by `save_to_disk`",
                                            files={"rows/part-0.jsonl": '{"text": "a"}\n'}),
    "tab-separated .csv": Case(("--dataset", "{tmp}/train.csv"), "train.csv' looks tab-separated (its header holds "
                               "'prompt', 'completion' between tabs, no comma), and a .csv file is read with commas: "
                               "write it comma-separated", files={"train.csv": "prompt\tcompletion\nrev ab=\tba\n"}),
    # DPO's settings that its loss would not read.
    "label smoothing under IPO": Case(("--method", "dpo", "--loss_type", "ipo", "--label_smoothing", "0.3"),
                                      "--label_smoothing 0.3 would be ignored: --loss_type ipo does not use it, only "
                                      "robust and exo_pair do: add one of them to --loss_type, or drop "
                                      "--label_smoothing."),
    "label smoothing under hinge": Case(("--method", "dpo", "--loss_type", "hinge", "--label_smoothing", "0.1"),
                                        "--label_smoothing 0.1 would be ignored: --loss_type hinge does not use it"),
    "label smoothing under the default sigmoid": Case(("--method", "dpo", "--label_smoothing", "0.1"),
                                                      "--loss_type sigmoid does not use it"),
    "label smoothing that no loss of several uses": Case(("--method", "dpo", "--loss_type", "sigmoid", "sft",
                                                          "--label_smoothing", "0.2"),
                                                         "--loss_type sigmoid sft does not use it"),
    # Hardware names for the memory plan.
    "unknown hardware": Case(("--hardware", "dgx-h100"), "Unknown hardware 'dgx-h100'. Valid: 8xh100-80gb"),
    "hardware without memory": Case(("--hardware", "9xh100"), "Unknown hardware '9xh100'"),
    "hardware with zero nodes": Case(("--hardware", "0x8xh100-80gb"), "needs at least one node"),
}
# Whatever the shell running the tests exported must not leak into a case.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def snapshot(root: Path) -> dict[str, tuple[int, bytes] | None]:
    return {str(path.relative_to(root)): (path.stat().st_mtime_ns, path.read_bytes()) if path.is_file() else None
            for path in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", CASES)
def test_refused_before_loading(case, tiny_assets, tmp_path, capsys, monkeypatch):
    """The recipe entry point itself, in this process (a launched refusal is tested below): exit code 2, one
    line naming the problem and the fix, no traceback, nothing loaded, nothing on disk created or changed."""
    spec = CASES[case]
    error_lines, stderr = refused(spec, tiny_assets, tmp_path, capsys, monkeypatch)
    assert len(error_lines) == 1 and spec.message in error_lines[0], stderr[-2000:]


def test_every_problem_reported_at_once(tiny_assets, tmp_path, capsys, monkeypatch):
    """Mistakes of two kinds on the command line (a flag, a data path): one launch names both, one line each,
    before anything heavy is imported. With the command line right, what only the model's config can judge is
    refused the same way."""
    spec = Case(("--learning_rat", "1e-4", "--dataset", "{tmp}/data/train.jsonl", "--max_seq_length", "4096"), "")
    error_lines, stderr = refused(spec, tiny_assets, tmp_path, capsys, monkeypatch)
    assert [line.split(":")[2].strip() for line in error_lines] == [
        "Unknown argument --learning_rat", "Dataset file not found"], stderr[-2000:]
    spec = Case(("--learning_rate", "1e-4", "--max_seq_length", "4096"), "")
    error_lines, stderr = refused(spec, tiny_assets, tmp_path, capsys, monkeypatch)
    assert [line.split(":")[2].strip() for line in error_lines] == [
        "--max_seq_length 4096 is above the model's max_position_embeddings 256"], stderr[-2000:]


def reached_the_trainer(*args, **kwargs):
    raise AssertionError("not refused: the run reached the trainer")


def refused(spec: Case, tiny_assets, tmp_path: Path, capsys, monkeypatch) -> tuple[list[str], str]:
    """Run the tiny recipe's entry point with `spec` and assert the refusal: exit code 2, no traceback, no weights
    loaded, nothing under tmp_path created or changed. Returns the error lines and all of stderr."""
    for name in [*os.environ]:
        if name in LAUNCH_VARIABLES or name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)
    for name, value in spec.env.items():
        monkeypatch.setenv(name, value)
    for module in spec.uninstalled:
        monkeypatch.setitem(sys.modules, module, None)  # importlib.util.find_spec then answers None
    if spec.offline:  # what HF_HUB_OFFLINE=1 sets when huggingface_hub is imported
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name, content in spec.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    before = snapshot(tmp_path)
    # A refusal that regressed would train, and the trainer ends its process with os._exit: pytest would stop there
    # with exit code 0 and every later test unrun. Reaching the trainer fails the test instead.
    monkeypatch.setattr("shardtune.trainer.train", reached_the_trainer)
    output_dir = tmp_path / "out"
    model_dir, data_file = tiny_assets
    argv = overridden(["--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir", str(output_dir),
                       "--report_to", "none", "--use_cpu", "true"], [arg.replace("{tmp}", str(tmp_path))
                                                                     for arg in spec.args])
    with pytest.raises(SystemExit) as exit_info:
        main(Recipe(name="tiny", max_seq_length=64, per_device_train_batch_size=16, global_batch_size=32), argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr and "Loading weights" not in stderr
    assert snapshot(tmp_path) == before  # no output_dir created, an earlier run's files untouched
    return [line for line in stderr.splitlines() if line.startswith("shardtune: error:")], stderr


# ---------------------------------------------------------------------------------------------------------------
# The planner (python -m shardtune.plan) and the scripts answer the same way: one line, exit code 2.

PLANNER = "shardtune.plan: error: "
DS_ZERO3_JSON = "accelerate_configs/deepspeed/zero3.json"
PLAN_CASES = {
    "DeepSpeed's JSON for an accelerate config": (
        ("--config_file", DS_ZERO3_JSON),
        f"--config_file '{DS_ZERO3_JSON}' is a DeepSpeed config JSON, not an accelerate config: give the accelerate "
        "config that uses it: accelerate_configs/ds_zero3.yaml or accelerate_configs/ds_zero3_ulysses.yaml."),
    "a YAML that is no accelerate config": (
        ("--config_file", "{tmp}/other.yaml"), "is not an accelerate config (it names no distributed_type"),
    "a config file that is not YAML": (
        ("--config_file", "{tmp}/broken.yaml"), "Cannot read accelerate config"),
    "a chart in a missing folder": (
        ("--chart", "{tmp}/missing_dir/x.png"),
        "/missing_dir/x.png': the folder '{tmp}/missing_dir' does not exist: create it (mkdir -p {tmp}/missing_dir) "
        "or give a path in an existing folder."),
    "a chart that is a folder": (("--chart", "{tmp}/plots.png"), "is a directory: give the PNG's file name"),
    "a number that is not one": (
        ("--per_device_train_batch_size", "x"),
        "Bad command line: argument --per_device_train_batch_size: invalid int value: 'x'; see --help for the "
        "planner's flags."),
    "another trainer's flag": (("--micro_batch_size", "x"),
                               "Unknown argument --micro_batch_size: did you mean --per_device_train_batch_size?"),
    "a misspelt flag with a negative value": (("--seq_len", "-3"),
                                              "Unknown argument --seq_len: did you mean --max_seq_length?"),
    "a negative length": (("--max_seq_length", "-3"), "--max_seq_length must be >= 2, got -3."),
    "a flag abbreviated": (("--hardw", "8xh100-80gb"), "Unknown argument --hardw: did you mean --hardware?"),
    "a stray value": (("stray",), "Unexpected value 'stray' on the command line"),
    "a reference that is not there": (
        ("--method", "dpo", "--ref_model_name_or_path", "{tmp}/no/ref"),
        "Model directory not found: '{tmp}/no/ref'. Check the path given to --ref_model_name_or_path."),
    "a reference of another tokenizer": (
        ("--method", "dpo", "--ref_model_name_or_path", "mistral-7b"),
        "--ref_model_name_or_path 'mistral-7b' has a vocabulary of 32000 tokens and the policy 128256"),
    "a model that is a file": (("--model", "{tmp}/other.yaml"),
                               "--model '{tmp}/other.yaml' is a file: give the model's directory, or a Hub model id."),
    "a recipe that does not parse": (("--model", "{tmp}/bad.py"),
                                     "--model '{tmp}/bad.py' does not parse as Python (invalid syntax, line 1)"),
}
PLAN_FILES = {"other.yaml": "num_processes: 2\n", "broken.yaml": "a: b: c\n", "plots.png/keep": "",
              "bad.py": "def recipe(:\n"}


@pytest.mark.parametrize("case", PLAN_CASES)
def test_planner_refuses_in_one_line(case, tmp_path, capsys):
    """In this process (nothing loads): exit code 2 and exactly one line on stderr, no usage block, no plan
    printed, and nothing written (a chart's folder not made)."""
    from shardtune.plan.__main__ import main as plan_main

    args, message = PLAN_CASES[case]
    for name, content in PLAN_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    before = snapshot(tmp_path)
    argv = ["--model", "llama-3.1-8b", *(arg.replace("{tmp}", str(tmp_path)) for arg in args)]
    assert plan_main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(PLANNER) and message.replace("{tmp}", str(tmp_path)) in err, err
    assert snapshot(tmp_path) == before


def test_planner_without_a_model_is_one_line(capsys):
    from shardtune.plan.__main__ import main as plan_main

    assert plan_main(["--compare"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PLANNER}Bad command line: the following arguments are required: --model; see --help for the planner's "
        "flags."]


def test_smoothing_refused_only_where_no_loss_reads_it():
    """With several --loss_type values, --label_smoothing stands where one of them reads it; 0 stands anywhere."""
    from shardtune.config import ConfigError
    from shardtune.methods.checks import check_dpo_values

    check_dpo_values(Recipe(method="dpo", loss_type=["sigmoid", "robust"], label_smoothing=0.1))
    check_dpo_values(Recipe(method="dpo", loss_type=["hinge", "exo_pair"], label_smoothing=1e-3))
    check_dpo_values(Recipe(method="dpo", loss_type=["ipo"], label_smoothing=0.0))
    with pytest.raises(ConfigError, match="--loss_type hinge ipo does not use it"):
        check_dpo_values(Recipe(method="dpo", loss_type=["hinge", "ipo"], label_smoothing=0.1))


def test_prepare_data_refuses_a_model_that_is_not_there(tiny_assets, tmp_path, capsys):
    """scripts/prepare_data.py judges --model_name_or_path before its tokenizer loads: a name that is no directory
    and no Hub id (transformers would ask the Hub for it), a missing path, a directory without config.json."""
    from tests.conftest import REPO, load_script

    prepare_data = load_script("prepare_data")
    (tmp_path / "weights").mkdir()
    cases = {"no_such_dir": "--model_name_or_path 'no_such_dir' is no directory here and no Hub model id "
                            "(owner/name): give the model's directory, or its Hub id.",
             str(tmp_path / "models" / "llama"): f"Model directory not found: '{tmp_path}/models/llama'",
             str(tmp_path / "weights"): "is a directory without config.json"}
    for model, message in cases.items():
        assert prepare_data.main([str(REPO / "recipes" / "tiny.py"), "--output_dir", str(tmp_path / "out"),
                                  "--model_name_or_path", model]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("shardtune: error: ") and message in err, (model, err)
    assert not (tmp_path / "out").exists()


def test_merge_lora_refuses_a_base_other_than_the_recorded_one(tiny_assets, tmp_path, capsys):
    """--base naming another model than adapter_config.json's base (still found) is refused before any weight
    loads, with the fix; the recorded base itself, by another path to the same directory, is not. --other_base
    alone names no base. (That --other_base merges: tests/unit/test_scripts.py.)"""
    from tests.conftest import load_script

    merge_lora = load_script("merge_lora")
    model_dir = tiny_assets[0]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": model_dir,
                                                             "peft_type": "LORA"}))
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    assert merge_lora.base_model(str(adapter), str(link)) == str(link)
    cases = {(str(other),): f"merge_lora: error: --base {other} is not the base {adapter}/adapter_config.json records "
                            f"({model_dir}), which the adapter was trained on: drop --base to merge into that one, or "
                            f"pass --base {model_dir}; add --other_base to merge into {other} all the same (a copy of "
                            "that base).",
             ("--other_base",): "merge_lora: error: --other_base merges into a base other than the recorded one, "
                                "which --base names: add --base, or drop --other_base.",
             ("--dtype", "int8"): "merge_lora: error: Bad command line: argument --dtype: invalid choice: 'int8' "
                                  "(choose from 'bf16', 'fp16', 'fp32'); see --help."}
    for extra, line in cases.items():
        argv = [str(adapter), str(tmp_path / "merged"), *(["--base", *extra] if extra[0][0] != "-" else extra)]
        with pytest.raises(SystemExit) if extra[0] == "--dtype" else contextlib.nullcontext() as exited:
            assert merge_lora.main(argv) == 2
        assert exited is None or exited.value.code == 2
        assert capsys.readouterr().err.splitlines() == [line]
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": ')
    assert merge_lora.main([str(adapter), str(tmp_path / "merged")]) == 2
    assert f"merge_lora: error: {adapter}/adapter_config.json is not a JSON object (" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists() and not (tmp_path / ".merged.tmp").exists()

"""Bad configuration stops with one clear line and exit code 2, before any model is loaded or file written."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub.constants
import pytest

from shardtune.cli import main
from shardtune.config import Recipe


@dataclass(frozen=True)
from tests.conftest import overridden
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



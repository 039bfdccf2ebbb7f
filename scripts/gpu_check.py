"""The one command that proves the trainer on a GPU: `make gpu-check` (or `python scripts/gpu_check.py`).

It makes a randomly initialised model of Llama-3.2-1B's shape (1.24B parameters, bf16 on disk, as Hub
checkpoints are) and synthetic text files, all local: nothing is downloaded. It then trains it through
`accelerate launch --num_processes 1` with the shipped DDP, FSDP FULL_SHARD (4 micro-batches per step) and
ZeRO-3 configs, bf16, gradient checkpointing on, padded (SDPA) and packed (flex attention), then FSDP packed with
the levers (compiled layers, torchao's 8-bit AdamW without an fp32 master), then FSDP and ZeRO-3 padded with Liger's
kernels (--use_liger_kernel), then FSDP padded with --mixed_precision fp8 where the GPU has float8 tensor cores
(compute capability 8.9 or more); the Liger and fp8 cases' losses against the same case without them
(LOSS_TOLERANCE). It prints one table:
the warm-up (the first logged window: CUDA start-up and flex attention's compilation), then over the later steps
tokens/s per GPU, MFU and step time, and `torch.cuda.max_memory_allocated` per phase (training, the final export,
the final eval; reset at each) against the planner's peak of that phase. No samples are generated.

Padded rows run from half to the whole --max_seq_length; packed rows all hold three quarters of it, so that a
packed micro-batch's row is known and planned at its real length. Each launch runs in a process group of its own
and is killed whole, ranks included, when it overruns: it is then a FAILED row, as is a case that did not start
within the budget. Exit 0 when every case trained and every planned peak is within 10% of the measured one; 1
otherwise, or when a Liger or fp8 case's losses leave its plain case's by more than its LOSS_TOLERANCE; 2
without a CUDA device. Sized for 10 minutes on one H200 (the levers case compiles).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The levers' recommended combination with the memory levers the 70B recipe without offload needs, as recipe
# fields: each becomes its --flag for the launch and its argument for the plan (LEVER_PLAN). Full checkpointing:
# selective is refused with compile (shardtune.checks.check_torch_compile).
LEVERS = {"torch_compile": True, "optim": "adamw_torch_8bit", "bf16_stochastic_round": True}
# Liger's kernels apart: they are refused with compile (shardtune.liger.check_liger_kernel).
LIGER = {"use_liger_kernel": True}
LEVER_PLAN = {"torch_compile": "torch_compile", "optim": "optim", "bf16_stochastic_round": "bf16_stochastic_round",
              "use_liger_kernel": "use_liger_kernel"}
# float8 linears with float8 all-gather (shardtune.float8): run where the GPU's capability reaches FP8_MIN_CAPABILITY.
FP8 = {"mixed_precision": "fp8"}
CASES = [  # (accelerate config, micro-batches per step, packing, recipe fields over the plain path)
    ("ddp", 1, False, {}), ("ddp", 1, True, {}),
    ("fsdp_full_shard", 4, False, {}), ("fsdp_full_shard", 4, True, {}),
    ("ds_zero3", 1, False, {}), ("ds_zero3", 1, True, {}),
    ("fsdp_full_shard", 4, True, LEVERS),
    ("fsdp_full_shard", 4, False, LIGER), ("ds_zero3", 1, False, LIGER),
    ("fsdp_full_shard", 4, False, FP8),
]
# Llama-3.2-1B's shape, at a length and micro-batch that keep each case well under a minute.
MODEL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192)
SEQ, MICRO, STEPS, LOG_EVERY = 2048, 4, 6, 2
PACKED_CHARACTERS = 3 * SEQ // 4 - 2  # a packed row's text: with BOS and EOS, three quarters of SEQ tokens
ROWS, EVAL_FRACTION = 400, 0.02  # 8 eval rows, one per batch
# The levers case compiles its layers and torchao's step first: it gets LEVERS_TIMEOUT_S.
BUDGET_S, CASE_TIMEOUT_S, LEVERS_TIMEOUT_S, KILL_GRACE_S = 600, 120, 240, 10
TOLERANCE = 0.10
# A compared case's logged losses against its plain case's (the same name without the suffix), relative: the same
# data and seed, six steps at lr 1e-5 of a random model whose loss is near ln(vocab). Liger: bf16 kernels that round
# differently (fused norm, SwiGLU and loss). fp8: e4m3 rounds each matmul operand by up to 6% (3 mantissa bits),
# which the loss, a mean over every token, averages far below 2%; broken scales or weights gathered wrong move it
# by more.
LOSS_TOLERANCE = {" liger": 0.01, " fp8": 0.02}
MEASURED_PHASES = (("train", "peak_memory_gb"), ("save", "save_peak_memory_gb"), ("eval", "eval_peak_memory_gb"))


@dataclass
class Finished:
    """How a launched command ended: its exit code (None: killed at its deadline) and its wall time."""

    returncode: int | None
    seconds: float


def run_killing_group(command: list[str], timeout: float, log_path: Path, env: dict[str, str]) -> Finished:
    """Run `command` in a session (and process group) of its own, its output to `log_path`. At `timeout` it is
    killed whole: SIGTERM, then after KILL_GRACE_S SIGKILL, to its group and to every descendant's group. torchrun
    starts each rank in a session of its own, which a signal to the launcher's group alone never reaches."""
    import psutil

    started, descendants = time.monotonic(), []
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
        try:
            returncode: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        # Also after a normal exit: whatever is left in its group would hold the GPU for the next case.
        with contextlib.suppress(psutil.Error):
            descendants = psutil.Process(process.pid).children(recursive=True)
        groups = {process.pid}
        for child in descendants:
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(child.pid))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, sig)
            if wait_until_dead(process, descendants, KILL_GRACE_S):
                break
    return Finished(returncode, time.monotonic() - started)


def wait_until_dead(process: subprocess.Popen, descendants: list, timeout: float) -> bool:
    """Whether `process` (reaped here) and every one of `descendants` (psutil processes; a zombie counts as dead:
    its parent, or init, collects it) ended within `timeout`."""
    import psutil

    def dead(descendant) -> bool:
        try:
            return descendant.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None and all(dead(descendant) for descendant in descendants):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def failure(log_path: Path, finished: Finished, timeout: float) -> str:
    if finished.returncode is None:
        return f"killed after {timeout:.0f} s (process group and ranks); log {log_path}"
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return f"exit {finished.returncode}: {lines[-1][:160] if lines else 'no output'}; log {log_path}"


def write_assets(root: Path) -> tuple[str, dict[bool, tuple[str, list[int]]]]:
    """The model (random weights, saved in bf16) with the tiny character tokenizer; the padded and the packed
    data files, each with its rows' token lengths as the trainer tokenizes them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.data import tokenize_plain
    from shardtune.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)
    with torch.device("cuda"):  # initialising 1.2B parameters on the CPU takes minutes
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    del model
    torch.cuda.empty_cache()
    rng = random.Random(0)
    data = {}
    for packing in (False, True):
        rows = [{"text": "".join(rng.choices(string.ascii_lowercase + " ", k=PACKED_CHARACTERS if packing else
                                            rng.randint(SEQ // 2, SEQ - 2)))} for _ in range(ROWS)]
        path = root / f"{'packed' if packing else 'padded'}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        ids, _ = tokenize_plain(rows, list(range(len(rows))), tokenizer, "text", False, str(path))
        data[packing] = (str(path), [min(len(row), SEQ) for row in ids])
    return str(root / "model"), data


def planned_seq(lengths: list[int], packing: bool) -> int:
    """The length to plan at: a padded micro-batch is as long as its longest row; a packed one is one row of
    MICRO rows, planned (as micro-batch x length) at the longest MICRO of them together."""
    longest = sorted(lengths, reverse=True)
    return math.ceil(sum(longest[:MICRO]) / MICRO) if packing else longest[0]


def planned_peaks(config: str, packing: bool, seq: int, levers: dict | None = None) -> dict[str, float]:
    """The planner's peak per measured phase, in GB: training (forward/backward and optimizer step), the final
    export, the final eval (one row per batch, as launched)."""
    import torch
    from transformers import LlamaConfig

    from shardtune.flops import shape_from_config
    from shardtune.hardware import Hardware
    from shardtune.plan.planner import plan
    from shardtune.plan.strategy import read_accelerate_config

    shape = shape_from_config(LlamaConfig(**MODEL), "llama-1.2b (random)")
    hardware = Hardware(1, 1, torch.cuda.get_device_properties(0).total_memory, name="1 GPU")
    levers = levers or {}
    strategy = read_accelerate_config(str(REPO / "accelerate_configs" / f"{config}.yaml"),
                                      mixed_precision=levers.get("mixed_precision", "bf16"))
    phases = plan(shape, hardware, strategy, MICRO, seq, checkpointing=True, attn="flash" if packing else "sdpa",
                  packing=packing, eval_batch=1, chunked_cross_entropy=True,  # the trainer's default
                  **{LEVER_PLAN[field]: value for field, value in levers.items() if field in LEVER_PLAN}).phases
    return {"train": max(phases["forward_backward"]["total"], phases["optimizer"]["total"]) / 1e9,
            "save": phases["save"]["total"] / 1e9, "eval": phases["eval"]["total"] / 1e9}


def summarize(rows: list[dict], planned: dict[str, float]) -> dict:
    """A case's figures from its metrics.jsonl rows: the first window apart (warm-up), the later ones timed."""
    windows = [row for row in rows if "loss" in row]
    timed = [row for row in windows if row["step"] > LOG_EVERY]
    if not windows or not timed:
        return {"error": "metrics.jsonl holds no timed window"}
    result = {"losses": [row["loss"] for row in windows],
              "warmup_s": windows[0]["step_time_s"] * windows[0]["step"],
              "tokens_per_second_per_gpu": statistics.mean(row["tokens_per_second_per_device"] for row in timed),
              "mfu": statistics.mean(row.get("mfu", float("nan")) for row in timed),
              "step_time_s": statistics.median(row["step_time_s"] for row in timed)}
    for phase, key in MEASURED_PHASES:
        values = [row[key] for row in rows if key in row]
        if not values:
            return {**result, "error": f"metrics.jsonl has no {key}"}
        measured = max(values)  # GB, as metrics.jsonl logs them and the planner counts
        result[f"{phase}_gb"], result[f"{phase}_planned_gb"] = measured, planned[phase]
        result[f"{phase}_error"] = planned[phase] / measured - 1
    return result


def case_name(config: str, accumulation: int, packing: bool, levers: dict) -> str:
    suffix = " liger" if levers.get("use_liger_kernel") else " fp8" if levers == FP8 else " levers" if levers else ""
    return f"{config} {'packed' if packing else 'padded'} x{accumulation}{suffix}"


def runs_here(levers: dict, capability: tuple[int, int]) -> bool:
    """Whether this GPU can run a case: fp8 needs float8 tensor cores (shardtune.float8.check_fp8)."""
    from shardtune.config import FP8_MIN_CAPABILITY

    return levers.get("mixed_precision") != "fp8" or tuple(capability) >= FP8_MIN_CAPABILITY


def lever_flags(levers: dict) -> list[str]:
    """The case's flags over the plain path (its precision is given apart: --mixed_precision)."""
    return [word for field, value in levers.items() if field != "mixed_precision"
            for word in (f"--{field}", str(value).lower())]


def run_case(config: str, accumulation: int, packing: bool, levers: dict, model: str, data: tuple[str, list[int]],
             root: Path, log_dir: Path, timeout: float) -> dict:
    name = case_name(config, accumulation, packing, levers)
    output_dir = root / name.replace(" ", "-")
    command = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
        str(REPO / "accelerate_configs" / f"{config}.yaml"), "--num_processes", "1", "--num_machines", "1",
        "--main_process_port", "29555", str(REPO / "recipes" / "tiny.py"),
        "--model_name_or_path", model, "--dataset", data[0], "--output_dir", str(output_dir),
        "--max_seq_length", str(SEQ), "--per_device_train_batch_size", str(MICRO),
        "--global_batch_size", str(MICRO * accumulation), "--max_steps", str(STEPS), "--logging_steps",
        str(LOG_EVERY), "--learning_rate", "1e-5", "--mixed_precision", levers.get("mixed_precision", "bf16"),
        "--gradient_checkpointing", "true",
        "--packing", str(packing).lower(), "--attn_implementation", "flex_attention" if packing else "sdpa",
        "--eval_fraction", str(EVAL_FRACTION), "--per_device_eval_batch_size", "1", "--generation_samples", "0",
        "--save_steps", "0", "--save_model", "true", "--report_to", "none", *lever_flags(levers),
    ]
    planned = planned_peaks(config, packing, planned_seq(data[1], packing), levers)
    log_path = log_dir / f"{output_dir.name}.log"
    finished = run_killing_group(command, timeout, log_path, {**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    row = {"case": name, "seconds": finished.seconds}
    if finished.returncode != 0:
        return {**row, "error": failure(log_path, finished, timeout)}
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {**row, **summarize(rows, planned)}


def print_table(rows: list[dict]) -> None:
    phases = "".join(f"{phase + ' GB':>10}{'plan':>7}" for phase, _ in MEASURED_PHASES)
    print(f"{'case':<34}{'warm-up s':>10}{'tok/s/GPU':>11}{'MFU':>7}{'step s':>8}{phases}{'worst':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['case']:<34} FAILED: {row['error']}")
            continue
        figures = "".join(f"{row[f'{phase}_gb']:>10.1f}{row[f'{phase}_planned_gb']:>7.1f}" for phase, _ in
                          MEASURED_PHASES)
        print(f"{row['case']:<34}{row['warmup_s']:>10.1f}{row['tokens_per_second_per_gpu']:>11,.0f}"
              f"{row['mfu']:>7.1%}{row['step_time_s']:>8.2f}{figures}{worst_error(row):>+8.1%}")
    for case, gap in loss_gaps(rows).items():
        suffix = compared_suffix(case)
        print(f"{case}: losses at most {gap:.2%} from {case.removesuffix(suffix)}'s "
              f"(tolerance {LOSS_TOLERANCE[suffix]:.0%})")


def worst_error(row: dict) -> float:
    return max((row[f"{phase}_error"] for phase, _ in MEASURED_PHASES), key=abs)


def compared_suffix(case: str) -> str:
    """The suffix of a case compared with its plain case (a LOSS_TOLERANCE key), else ''."""
    return next((suffix for suffix in LOSS_TOLERANCE if case.endswith(suffix)), "")


def loss_gaps(rows: list[dict]) -> dict[str, float]:
    """Each compared case's (Liger, fp8) largest relative gap between its logged losses and those of the same case
    without the lever; NaN where either did not train."""
    by_case = {row["case"]: row for row in rows}
    gaps = {}
    for row in rows:
        suffix = compared_suffix(row["case"])
        if not suffix:
            continue
        plain = by_case.get(row["case"].removesuffix(suffix), {})
        if "losses" not in row or "losses" not in plain or len(row["losses"]) != len(plain["losses"]):
            gaps[row["case"]] = math.nan
            continue
        gaps[row["case"]] = max(abs(mine / theirs - 1) for mine, theirs in zip(row["losses"], plain["losses"],
                                                                               strict=True))
    return gaps


def failed_cases(rows: list[dict]) -> list[str]:
    gaps = loss_gaps(rows)
    return [row["case"] for row in rows if "error" in row or abs(worst_error(row)) > TOLERANCE
            or not gaps.get(row["case"], 0.0) <= LOSS_TOLERANCE.get(compared_suffix(row["case"]), 0.0)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--log_dir", default=str(REPO / "logs" / "gpu-check"),
                        help="each case's launch output, kept after the run (default: %(default)s)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device is visible; run `make gpu-check` on a GPU machine.", file=sys.stderr)
        return 2
    deadline = time.monotonic() + BUDGET_S
    capability = torch.cuda.get_device_capability(0)
    cases = [case for case in CASES if runs_here(case[3], capability)]
    print(f"gpu_check: {torch.cuda.get_device_name(0)} (compute capability {capability[0]}.{capability[1]}), "
          f"{len(cases)} cases, budget {BUDGET_S} s" + ("" if len(cases) == len(CASES) else
                                                       "; fp8 skipped: no float8 tensor cores"), flush=True)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        root = Path(scratch)
        model, data = write_assets(root)
        rows = []
        for config, accumulation, packing, levers in cases:
            left = deadline - time.monotonic()
            name = case_name(config, accumulation, packing, levers)
            if left < 30:
                rows.append({"case": name, "error": f"not started: the {BUDGET_S} s budget was spent"})
            else:
                rows.append(run_case(config, accumulation, packing, levers, model, data[packing], root, log_dir,
                                     min(LEVERS_TIMEOUT_S if "torch_compile" in levers else CASE_TIMEOUT_S,
                                         left)))
            print(json.dumps(rows[-1]), flush=True)
        print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    failed = failed_cases(rows)
    if failed:
        print(f"gpu_check: {len(failed)} case(s) failed, missed the plan by more than {TOLERANCE:.0%} or the "
              "plain losses by more than their tolerance: "
              f"{', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The command that proves the trainer on a GPU: `make gpu-check` (or `python scripts/gpu_check.py`).

It writes a randomly initialised model of Llama-3.2-1B's shape (1.24B parameters, bf16 on disk) and synthetic text
files, all local, and trains it through `accelerate launch --num_processes 1` (CASES): FSDP FULL_SHARD (4
micro-batches per step) padded with --mixed_precision fp8 (compiled; where the GPU has float8 tensor cores), with
Liger's kernels and plain; FSDP packed with the levers and plain; ZeRO-3 padded with Liger and plain; then DDP, FSDP
and ZeRO-3 in the other layouts; bf16, gradient checkpointing on, padded (SDPA) or packed (flex attention). Each
Liger, fp8 and levers case is compared with its plain twin on every logged gradient norm and loss and (Liger, fp8)
the final hidden states of a fixed batch (each exported model with its case's kernels)
(shardtune.gpu_check.figures.COMPARED); the modules Liger and fp8 replaced in the trained model are counted
(scripts/device_counted_launch.py) and must be the planned number. The table gives the warm-up apart, then per timed
step tokens/s per GPU, MFU, step time and the training peak of max_memory_allocated beside max_memory_reserved and
the device memory in use, the export's and the eval's peaks, each against the planner's, and the planner's reserves
against what was reserved.

The device tool's 15 minutes hold two calls, each on a fresh machine and self-contained (its model, data and the
plain twin of each comparison it makes): `--call 1` (CALLS) and `--call 2`. The budget (--budget_s) counts from
this process's start, or from --since (the device command's, so that the wheel install counts). A case starts only
with what its kind needs left (scripts/device_budget.py), its plain twin's too where that is still to run, before
its kill and the closing; its timeout is cut to fit; a case not started is a row saying so, which `--rest` (or
`--cases` in a later call) runs. `--cases` runs a subset and the plain twins of its compared cases. As each case
ends, and again on SIGTERM or SIGINT: its row and each comparison are appended to --out (JSON Lines), the table is
written to --table and the logs to the --archive tar.gz. SIGTERM or SIGINT kills the running case's process groups,
removes the temporary files, writes those files and exits 128 + the signal. Exit 0 when every case trained within
the plan (TOLERANCE) and the planner's reserves and every comparison is within its tolerance; else 1; 2 for bad
arguments or without a CUDA device. Nothing is downloaded and no samples are generated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import string
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))  # device_budget beside it, also when loaded by path
from device_budget import (  # noqa: E402
    ASSETS_S,
    CLOSING_S,  # noqa: F401 (the tests read the budget's figures here)
    FIRST_CALL_S,
    KILL_GRACE_S,  # noqa: F401
    LIMIT_FACTOR,
    PROBE_S,
    budget_left,
    case_seconds,
    time_for,
)
from gpu_wheels import installed_problems  # noqa: E402

from shardtune.checks.command_line import OneLineParser  # noqa: E402
from shardtune.gpu_check.figures import (  # noqa: E402
    COMPARED,
    TOLERANCE,
    Reporter,
    as_json,
    case_name,
    compared_suffix,
    earlier_records,
    failed_cases,
    final_hidden_states,
    new_comparisons,
    not_run,
    planned_replacements,
    print_table,
    summarize,
)
from shardtune.gpu_check.processes import (  # noqa: E402, F401 (the tests reach them here)
    Finished,
    Stopped,
    failure,
    in_scratch,
    run_killing_group,
)

REPO = Path(__file__).resolve().parents[1]
# The levers' recommended combination with the memory levers the 70B recipe without offload needs, as recipe
# fields: each becomes its --flag for the launch and its argument for the plan (LEVER_PLAN). Full checkpointing:
# selective is refused with compile (shardtune.checks.values.check_torch_compile).
LEVERS = {"torch_compile": True, "optim": "adamw_torch_8bit", "bf16_stochastic_round": True}
# Liger's kernels apart: they are refused with compile (shardtune.levers.liger.check_liger_kernel).
LIGER = {"use_liger_kernel": True}
# float8 linears with float8 all-gather (levers.float8), compiled: eager, torchao's casts run unfused and slower
# than bf16 (shardtune.levers.float8.unfused_fp8_warning). Run where the GPU's capability reaches FP8_MIN_CAPABILITY.
FP8 = {"mixed_precision": "fp8", "torch_compile": True}
LEVER_PLAN = {"torch_compile": "torch_compile", "optim": "optim", "bf16_stochastic_round": "bf16_stochastic_round",
              "use_liger_kernel": "use_liger_kernel"}


class Case(NamedTuple):
    config: str  # accelerate config
    accumulation: int  # micro-batches per step
    packing: bool
    levers: dict  # recipe fields over the plain path


# The never-run features first (fp8, Liger, the levers), each compared case beside its plain twin.
CASES = [
    Case("fsdp_full_shard", 4, False, FP8), Case("fsdp_full_shard", 4, False, LIGER),
    Case("fsdp_full_shard", 4, False, {}), Case("fsdp_full_shard", 4, True, LEVERS),
    Case("ds_zero3", 1, False, LIGER), Case("ds_zero3", 1, False, {}),
    Case("ddp", 1, False, {}), Case("ddp", 1, True, {}), Case("fsdp_full_shard", 4, True, {}),
    Case("ds_zero3", 1, True, {}),
]
# The device tool's two calls, each on a fresh machine with its own plain twins (CASES' indices, in running order):
# the first fp8, Liger and their plain twin, ZeRO-3 plain, within FIRST_CALL_S of its start; the second the rest,
# ZeRO-3's Liger pair and the levers' first (docs/planner.md).
CALLS = {1: [CASES[i] for i in (0, 1, 2, 5)], 2: [CASES[i] for i in (4, 5, 3, 8, 6, 7, 9)]}
# Llama-3.2-1B's shape, at a length and micro-batch that keep each case well under a minute once warm.
MODEL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192)
SEQ, MICRO, STEPS = 2048, 4, 6  # every step logged: step 1's gradient norm is compared
PACKED_CHARACTERS = 3 * SEQ // 4 - 2  # a packed row's text: with BOS and EOS, three quarters of SEQ tokens
ROWS, EVAL_FRACTION = 400, 0.02  # 8 eval rows, one per batch
PROBE_ROWS, PROBE_SEQ = 2, 512  # the fixed batch whose final hidden states are compared


# --- budget ----------------------------------------------------------------------------------------------------


def case_needs(case: Case) -> float:
    """What the case needs (scripts/device_budget.py): its kind's time, its probe's where it is probed."""
    return case_seconds(case.config, case.levers, probed(case_name(*case)))


def plain_twin(case: Case) -> Case | None:
    """The plain case a compared case is compared with, else None."""
    return Case(case.config, case.accumulation, case.packing, {}) if compared_suffix(case_name(*case)) else None


def process_start() -> float:
    """This process's start (Unix time), before the interpreter's and torch's imports."""
    import psutil

    return psutil.Process().create_time()


# --- assets and plan -------------------------------------------------------------------------------------------


def write_assets(root: Path) -> None:
    """(In a child process: its CUDA context ends with it.) The model (random weights, saved in bf16) with the tiny
    character tokenizer; the padded and the packed data files; lengths.json, each file's rows' token lengths as the
    trainer tokenizes them; probe_ids.pt, the fixed batch of the hidden-state comparison."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.data.tokenize import tokenize_plain
    from shardtune.models.tiny_assets import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)
    with torch.device("cuda"):  # initialising 1.2B parameters on the CPU takes minutes
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    lengths = {}
    for packing in (False, True):
        rows = [{"text": "".join(rng.choices(string.ascii_lowercase + " ", k=PACKED_CHARACTERS if packing else
                                            rng.randint(SEQ // 2, SEQ - 2)))} for _ in range(ROWS)]
        path = root / f"{'packed' if packing else 'padded'}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        ids, _ = tokenize_plain(rows, list(range(len(rows))), tokenizer, "text", False, str(path))
        lengths[path.stem] = [min(len(row), SEQ) for row in ids]
        if not packing:
            torch.save(torch.tensor([row[:PROBE_SEQ] for row in ids[:PROBE_ROWS]]), root / "probe_ids.pt")
    (root / "lengths.json").write_text(json.dumps(lengths))


def planned_seq(lengths: list[int], packing: bool) -> int:
    """The length to plan at: a padded micro-batch is as long as its longest row; a packed one is one row of
    MICRO rows, planned (as micro-batch x length) at the longest MICRO of them together."""
    longest = sorted(lengths, reverse=True)
    return math.ceil(sum(longest[:MICRO]) / MICRO) if packing else longest[0]


def planned_peaks(config: str, packing: bool, seq: int, gpu_memory: int, levers: dict | None = None) -> dict:
    """The planner's peak per measured phase, in GB: training (forward/backward and optimizer step), the final
    export, the final eval (one row per batch, as launched)."""
    from transformers import LlamaConfig

    from shardtune.models.flops import shape_from_config
    from shardtune.plan.hardware import Hardware
    from shardtune.plan.planner import plan
    from shardtune.plan.strategy import read_accelerate_config

    shape = shape_from_config(LlamaConfig(**MODEL), "llama-1.2b (random)")
    hardware = Hardware(1, 1, gpu_memory, name="1 GPU")
    levers = levers or {}
    strategy = read_accelerate_config(str(REPO / "accelerate_configs" / f"{config}.yaml"),
                                      mixed_precision=levers.get("mixed_precision", "bf16"))
    phases = plan(shape, hardware, strategy, MICRO, seq, checkpointing=True, attn="flash" if packing else "sdpa",
                  packing=packing, eval_batch=1, chunked_cross_entropy=True,  # the trainer's default
                  **{LEVER_PLAN[field]: value for field, value in levers.items() if field in LEVER_PLAN}).phases
    return {"train": max(phases["forward_backward"]["total"], phases["optimizer"]["total"]) / 1e9,
            "save": phases["save"]["total"] / 1e9, "eval": phases["eval"]["total"] / 1e9}


# --- a case ----------------------------------------------------------------------------------------------------


def case_slug(case: Case) -> str:
    """A case's name as --cases takes it and its output directory is named."""
    return case_name(*case).replace(" ", "-")


def runs_here(levers: dict, capability: tuple[int, int]) -> bool:
    """Whether this GPU can run a case: fp8 needs float8 tensor cores (shardtune.levers.float8.check_fp8)."""
    from shardtune.config import FP8_MIN_CAPABILITY

    return levers.get("mixed_precision") != "fp8" or tuple(capability) >= FP8_MIN_CAPABILITY


def lever_flags(levers: dict) -> list[str]:
    """The case's flags over the plain path (its precision is given apart: --mixed_precision)."""
    return [word for field, value in levers.items() if field != "mixed_precision"
            for word in (f"--{field}", str(value).lower())]


def launch_command(case: Case, model: str, data: str, output_dir: Path, seq: int = SEQ, micro: int = MICRO,
                   steps: int = STEPS) -> list[str]:
    """The case's `accelerate launch` (the sizes given apart for scripts/device_rehearsal.py's tiny model)."""
    return [  # accelerate's launcher as a module of this interpreter: its console script may sit elsewhere
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(REPO / "accelerate_configs" / f"{case.config}.yaml"), "--num_processes", "1", "--num_machines", "1",
        "--main_process_port", "29555", str(REPO / "scripts" / "device_counted_launch.py"),
        str(REPO / "recipes" / "tiny.py"),
        "--model_name_or_path", model, "--dataset", data, "--output_dir", str(output_dir),
        "--max_seq_length", str(seq), "--per_device_train_batch_size", str(micro),
        "--global_batch_size", str(micro * case.accumulation), "--max_steps", str(steps), "--logging_steps", "1",
        "--learning_rate", "1e-5", "--mixed_precision", case.levers.get("mixed_precision", "bf16"),
        "--gradient_checkpointing", "true",
        "--packing", str(case.packing).lower(), "--attn_implementation", "flex_attention" if case.packing else "sdpa",
        "--eval_fraction", str(EVAL_FRACTION), "--per_device_eval_batch_size", "1", "--generation_samples", "0",
        "--save_steps", "0", "--save_model", "true", "--report_to", "none", *lever_flags(case.levers),
    ]


# --- hidden states ---------------------------------------------------------------------------------------------


def probed(name: str) -> bool:
    """Whether a case's final hidden states are compared: a case compared on them, or the plain case of one."""
    def on_hidden(other: str) -> bool:
        return "hidden" in COMPARED.get(compared_suffix(other), {})

    return on_hidden(name) or any(on_hidden(other) and other.removesuffix(compared_suffix(other)) == name
                                  for other in map(lambda case: case_name(*case), CASES))


def probe(out: str, model_dir: str, ids_file: str, suffix: str) -> None:
    """(In a child process: its CUDA context ends with it.) final_hidden_states of one exported model, to `out`."""
    import torch

    torch.save(final_hidden_states(model_dir, suffix, torch.load(ids_file)), out)


def add_hidden_states(row: dict, output_dir: Path, root: Path, log_dir: Path, left: float) -> None:
    """The trained case's final hidden states of the fixed batch, kept in log_dir (a later command compares with
    them): row["hidden_file"], or row["hidden_error"] saying why not."""
    limit = time_for(LIMIT_FACTOR * PROBE_S, PROBE_S, left)
    if limit is None:
        row["hidden_error"] = "not probed: the budget was spent"
        return
    out, log_path = log_dir / f"{output_dir.name}.hidden.pt", log_dir / f"{output_dir.name}.probe.log"
    out.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--probe", str(out), str(output_dir), str(root / "probe_ids.pt"),
               compared_suffix(row["case"])]
    finished = run_killing_group(command, limit, log_path, child_env())
    if finished.returncode == 0:
        row["hidden_file"] = str(out)
    else:
        row["hidden_error"] = failure(log_path, finished, limit)


# --- the run ---------------------------------------------------------------------------------------------------


def selected_cases(names: str | None, call: int | None = None) -> list[Case]:
    """The call's cases (CALLS), CASES without one, or those `--cases` names (comma-separated, as case_slug writes
    them) with the plain twin of each compared one, in CASES' order. Raises ValueError naming the unknown ones and
    every known one."""
    if not names:
        return list(CALLS[call]) if call else list(CASES)
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = {case_slug(case): case for case in CASES}
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        raise ValueError(f"--cases {', '.join(unknown) or repr(names)}: not a case; give some of "
                         f"{','.join(known)}")
    twins = {case_slug(plain_twin(known[name])) for name in wanted if plain_twin(known[name])}
    return [case for case in CASES if case_slug(case) in set(wanted) | twins]


def child_env() -> dict[str, str]:
    """The environment of every process this one starts: shardtune importable from this checkout, before whatever
    PYTHONPATH already holds (the device command's wheel directory)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}


def run_cases(root: Path, cases: list[Case], deadline: float, args, gpu_memory: int, rows: list,
              comparisons: list, reporter: Reporter) -> None:
    """Each case in turn, within the budget, into `rows` (and the reporter's files as each ends); each comparison
    once a compared case and its plain twin have trained, here or in an earlier command with the same --out, into
    `comparisons`. A case starts only with what it needs left, its plain twin's too where that is still to run;
    a compared case whose twin did not train here or earlier is not started."""
    log_dir, earlier = Path(args.log_dir), earlier_records(args.out)
    latest = {record["case"]: record for record in earlier if "case" in record}
    done = {record["comparison"] for record in earlier if "comparison" in record}
    limit = time_for(LIMIT_FACTOR * ASSETS_S, ASSETS_S, deadline - time.monotonic()) or 1
    finished = run_killing_group([sys.executable, __file__, "--write_assets", str(root)], limit,
                                 log_dir / "assets.log", child_env())
    if finished.returncode != 0:
        for case in cases:
            rows.append({"case": case_name(*case), "error": "not started: the model and data were not written: "
                                                              f"{failure(log_dir / 'assets.log', finished, limit)}"})
            reporter.append(rows[-1])
        reporter.write(rows, comparisons)
        return
    lengths = json.loads((root / "lengths.json").read_text())
    for index, case in enumerate(cases):
        name, kind, output_dir = case_name(*case), "packed" if case.packing else "padded", root / case_slug(case)
        twin = plain_twin(case)
        twin_name = case_name(*twin) if twin else None
        twin_later = twin in cases[index + 1:] and twin_name not in latest
        needs = case_needs(case) + (case_needs(twin) if twin_later else 0)
        limit = time_for(LIMIT_FACTOR * case_needs(case), needs, deadline - time.monotonic())
        row = {"case": name, "error": f"not started: the budget left no {needs:.0f} s for it (run it again: "
                                      "--rest, or --cases in a later call)"}
        if twin and not twin_later and "error" in latest.get(twin_name, {"error": ""}):
            row["error"] = f"not started: its plain twin {twin_name} did not train (run both again)"
        elif limit is not None:
            row = run_case(case, root, output_dir, log_dir, limit, lengths[kind], gpu_memory, deadline)
        rows.append(row)
        latest[name] = row
        reporter.append(row)
        print(json.dumps(as_json(row)), flush=True)
        for found in new_comparisons(latest, done):
            comparisons.append(found)
            done.add(found["comparison"])
            reporter.append(found)
        reporter.write(rows, comparisons)


def run_case(case: Case, root: Path, output_dir: Path, log_dir: Path, limit: float, lengths: list[int],
             gpu_memory: int, deadline: float) -> dict:
    """One case launched, summarized and (where compared) its replaced modules and hidden states added."""
    name, kind = case_name(*case), "packed" if case.packing else "padded"
    log_path, replaced_file = log_dir / f"{case_slug(case)}.log", log_dir / f"{case_slug(case)}.replaced.json"
    replaced_file.unlink(missing_ok=True)
    planned = planned_peaks(case.config, case.packing, planned_seq(lengths, case.packing), gpu_memory, case.levers)
    command = launch_command(case, str(root / "model"), str(root / f"{kind}.jsonl"), output_dir)
    ended = run_killing_group(command, limit, log_path, {**child_env(), "SHARDTUNE_REPLACED_FILE": str(replaced_file)})
    row = {"case": name, "seconds": ended.seconds}
    if ended.returncode != 0:
        row["error"] = failure(log_path, ended, limit)
        return row
    metrics_text = (output_dir / "metrics.jsonl").read_text()
    (log_dir / f"{case_slug(case)}.metrics.jsonl").write_text(metrics_text)  # in the archive
    row.update(summarize([json.loads(line) for line in metrics_text.splitlines()], planned, gpu_memory / 1e9))
    expected = planned_replacements(compared_suffix(name), MODEL["num_hidden_layers"])
    if expected:
        row["replaced_planned"] = expected
        row["replaced"] = json.loads(replaced_file.read_text()) if replaced_file.is_file() else None
    if probed(name):
        add_hidden_states(row, output_dir, root, log_dir, deadline - time.monotonic())
    return row


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--call", type=int, choices=sorted(CALLS), help="the device tool's call: its cases (CALLS)")
    parser.add_argument("--cases", help="comma-separated cases to run, with the plain twins of the compared ones, in "
                        "CASES' order (default: all, or the call's): " + ",".join(case_slug(case) for case in CASES))
    parser.add_argument("--out", help="append each case's row and each comparison to this JSON Lines file as it ends")
    parser.add_argument("--table", help="write the table to this file as each case ends and on SIGTERM")
    parser.add_argument("--archive", help="write --log_dir's logs to this tar.gz as each case ends and on SIGTERM")
    parser.add_argument("--rest", action="store_true", help="with --out: only the cases it holds no row of, or a "
                        "row saying they were not started (a second command after a first that the budget cut)")
    parser.add_argument("--budget_s", type=float, default=FIRST_CALL_S, help="seconds the whole command may take "
                        "(default: %(default)s; the second device call's: scripts/device_budget.second_call_budget)")
    parser.add_argument("--since", type=float, help="the Unix time the budget counts from (default: this process's "
                        "start); the device command passes its own start, so that the wheel install counts")
    parser.add_argument("--log_dir", default=str(REPO / "logs" / "gpu-check"),
                        help="each case's launch output, kept after the run (default: %(default)s)")
    parser.add_argument("--write_assets", help=argparse.SUPPRESS)  # the child processes of run_cases
    parser.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_or_exit(argv)
    if args.write_assets:
        write_assets(Path(args.write_assets))
        return 0
    if args.probe:
        probe(*args.probe)
        return 0
    deadline = time.monotonic() + budget_left(args.since or process_start(), args.budget_s)
    try:
        cases = selected_cases(args.cases, args.call)
    except ValueError as error:
        print(f"gpu_check: error: {error}", file=sys.stderr)
        return 2
    if args.rest and not args.out:
        print("gpu_check: error: --rest runs the cases the --out file holds no row of: give --out.", file=sys.stderr)
        return 2
    if args.rest:
        cases = not_run(cases, earlier_records(args.out))
        if not cases:
            print(f"gpu_check: every case has a row in {args.out} already: nothing to run.")
            return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device is visible; run `make gpu-check` on a GPU machine.", file=sys.stderr)
        return 2
    capability = torch.cuda.get_device_capability(0)
    skipped = [case_slug(case) for case in cases if not runs_here(case.levers, capability)]
    cases = [case for case in cases if runs_here(case.levers, capability)]
    print(f"gpu_check: {torch.cuda.get_device_name(0)} (compute capability {capability[0]}.{capability[1]}), "
          f"torch {torch.__version__}, {len(cases)} cases, {deadline - time.monotonic():.0f} s of the "
          f"{args.budget_s:.0f} s budget left" + (f"; skipped {', '.join(skipped)}: no float8 tensor cores"
                                                   if skipped else ""), flush=True)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    comparisons: list[dict] = []
    reporter = Reporter(args)
    problems = installed_problems()  # the device's versions its list did not give, read where they are installed
    for problem in problems:
        print(f"gpu_check: warning: {problem}: the cases that import it will fail; carry that version "
              "(scripts/device_packages.txt)", flush=True)
    if problems:
        reporter.append({"environment": problems})
    memory = torch.cuda.get_device_properties(0).total_memory
    stopped = in_scratch(lambda root: run_cases(root, cases, deadline, args, memory, rows, comparisons, reporter))
    reporter.write(rows, comparisons)  # again: a signal may have ended a case since the last write
    if stopped:
        print(f"gpu_check: stopped by {signal.Signals(stopped).name}: the running case was killed, the temporary "
              "files removed; the table holds the cases that ended", file=sys.stderr)
    print_table(rows, comparisons)
    if stopped:
        return 128 + stopped
    failed = failed_cases(rows, comparisons)
    if failed:
        print(f"gpu_check: {len(failed)} case(s) failed, missed the plan by more than {TOLERANCE:.0%}, a planned "
              f"reserve or module count, logged a NaN, or missed their plain twin's figures by more than their "
              f"tolerance: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

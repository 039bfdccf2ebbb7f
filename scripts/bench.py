"""Benchmark a recipe under an accelerate config: tokens/s per device, MFU, peak memory and step time.

    python scripts/bench.py --config_file accelerate_configs/fsdp_full_shard.yaml --recipe recipes/llama8b.py \
        --num_processes 8 --steps 30 -- --dataset data/train.jsonl --per_device_train_batch_size 2

Flags after `--` go to the recipe. The first `--warmup` steps are left out of the figures. Without CUDA it
also runs a bare accelerate loop (forward, backward, clip, step: no logging, checks or checkpoints) on the
same model, data and batches, and prints the trainer's throughput as a ratio of it.

    python scripts/bench.py --levers --config_file accelerate_configs/fsdp_full_shard.yaml --recipe recipes/tiny.py \
        --num_processes 2 --steps 12 -- --use_cpu true --dataset data/train.jsonl

With --levers it prints one table instead: the plain path (every lever off, levers.catalogue.PLAIN_FLAGS), each
lever alone over it, and the recommended combination (the levers that cost no precision and run here), with
tokens/s per device, the peak memory and each row's ratio to the plain path. The peak is rank 0's allocated peak
on CUDA; elsewhere the peak of live tensor bytes of the training steps on any rank, from the profiler's allocator
events (SHARDTUNE_PROFILE_MEMORY: its first steps only, inside the warm-up). A row the start-up checks refuse (a
plan that does not fit, for one) is shown as failed, and the table goes on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardtune.checks.command_line import OneLineParser

REPO = Path(__file__).resolve().parents[1]
LOG_EVERY = 5  # the trainer's figures are per logging window; the warm-up should be a multiple of it


def run_launcher(command: list[str], timeout_s: float, capture: bool = False) -> str:
    """Run one `accelerate launch` to its end, or stop it and all its ranks after `timeout_s`: the ranks guard
    themselves (collective timeouts, the dead-rank watchdog), this is the last line for anything else."""
    process = subprocess.Popen(command, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, text=True,
                               stdout=subprocess.PIPE if capture else None, start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)  # the launcher forwards it to its ranks, which save nothing here
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        raise SystemExit(f"bench: error: {' '.join(command[:6])} ... still running after {timeout_s:.0f}s: "
                         "stopped") from None
    if process.returncode != 0:
        raise SystemExit(f"bench: error: {' '.join(command[:6])} ... exited with {process.returncode}")
    return stdout or ""


def launch(args: argparse.Namespace, script: list[str], output_dir: Path, extra: tuple[str, ...] = ()) -> None:
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", args.config_file,
               "--num_processes", str(args.num_processes), *script, "--max_steps", str(args.steps),
               "--logging_steps", str(LOG_EVERY), "--eval_steps", "0", "--save_steps", "0", "--save_model", "false",
               "--report_to", "none", "--output_dir", str(output_dir), *args.recipe_args, *extra]
    run_launcher(command, args.timeout_s)


def summarize(rows: list[dict], warmup: int) -> dict:
    timed = [row for row in rows if "loss" in row and row["step"] > warmup]
    if not timed:
        raise SystemExit(f"bench: error: no steps after the {warmup} warm-up steps; raise --steps.")
    summary = {
        "tokens_per_second_per_device": statistics.mean(row["tokens_per_second_per_device"] for row in timed),
        "step_time_s": statistics.median(row["step_time_s"] for row in timed),
    }
    for key in ("mfu", "tflops_per_gpu", "peak_memory_gb", "peak_rss_gb"):  # each window logs its own peak
        if key in timed[-1]:
            values = [row[key] for row in rows if key in row]
            summary[key] = max(values) if key.startswith("peak") else statistics.mean(row[key] for row in timed)
    return summary


def bare_loop(recipe_path: str, steps: int, warmup: int, recipe_args: list[str]) -> None:
    """Run under `accelerate launch`: the plainest accelerate loop over the trainer's own batches."""
    import torch

    from shardtune.checks.startup import validate
    from shardtune.flags import parse_recipe
    from shardtune.launch import LaunchDescription
    from shardtune.parallel.distributed import make_accelerator, shut_down
    from shardtune.parallel.ranks import check_ranks_agree, launch_fingerprint, watch_ranks

    spec = importlib.util.spec_from_file_location("bench_recipe", recipe_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    recipe = parse_recipe(module.RECIPE, [*recipe_args, "--overwrite_output_dir", "true"])
    launch = LaunchDescription.from_env()
    world_size = launch.world_size
    batching = validate(recipe, launch, has_gpu=torch.cuda.is_available())
    accelerator = make_accelerator(recipe, batching, launch, log_with=None)
    # The trainer's guards: ranks launched alike, start-up then step collective timeouts, the dead-rank watchdog,
    # and the teardown that cannot deadlock at exit.
    machines = check_ranks_agree(accelerator, launch_fingerprint(accelerator, recipe, batching, launch, 0))
    with watch_ranks(accelerator, recipe, machines):
        bare_steps(accelerator, recipe, batching, steps, warmup, world_size)
    shut_down(accelerator)


def bare_steps(accelerator, recipe, batching, steps: int, warmup: int, world_size: int) -> None:
    import torch

    from shardtune.config import token_multiple
    from shardtune.data.batches import COUNTS, global_batches, make_collator
    from shardtune.data.loading import load_splits
    from shardtune.model import load_model, load_tokenizer
    from shardtune.parallel.ranks import set_collective_timeout
    from shardtune.step import clipping_limit

    tokenizer = load_tokenizer(recipe)
    with accelerator.main_process_first():
        train_set, _ = load_splits(recipe, tokenizer)
    model = load_model(recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    loader = torch.utils.data.DataLoader(train_set, batch_size=batching.micro_batch, shuffle=True, drop_last=True,
                                         collate_fn=make_collator(tokenizer, recipe.packing, recipe.attn_implementation,
                                                                  token_multiple(recipe)))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    set_collective_timeout(recipe.collective_timeout_minutes)  # start-up is over: a long wait now is a hang
    batches = global_batches(loader, batching, len(train_set) // batching.global_batch)
    times, tokens = [], []
    for step in range(1, steps + 1):
        started = time.perf_counter()  # data loading counts, as it does in the trainer's tokens/s
        micro_batches = next(batches)
        counts = [batch.pop(COUNTS) for batch in micro_batches]  # the trainer's host-side counts, free here too
        for batch in micro_batches:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), clipping_limit(recipe.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad()
        if step > warmup:
            times.append(time.perf_counter() - started)
            tokens.append(sum(count["tokens"] for count in counts))
    total_tokens = accelerator.reduce(torch.tensor(float(sum(tokens)), device=accelerator.device), "sum").item()
    if accelerator.is_main_process:
        print("BARE " + json.dumps({"tokens_per_second_per_device": total_tokens / sum(times) / world_size}))


def input_problems(args: argparse.Namespace) -> list[str]:
    """Every impossible input, one line each, before a process is launched."""
    problems = [f"--{name} {path!r} does not exist: give {what}." for name, path, what in (
        ("recipe", args.recipe, "a recipe file, e.g. recipes/tiny.py"),
        ("config_file", args.config_file, "an accelerate config YAML, e.g. accelerate_configs/ddp.yaml"))
        if not os.path.isfile(path)]
    problems += [f"--{name} must be > 0, got {getattr(args, name)}." for name in
                 ("num_processes", "steps", "repeats", "timeout_s") if not getattr(args, name) > 0]
    if not 0 <= args.warmup < args.steps:
        problems.append(f"--warmup must be >= 0 and below --steps ({args.steps}), got {args.warmup}: the figures "
                        "come from the steps after it.")
    return problems


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    recipe_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config_file", required=True, help="the accelerate config YAML to launch under")
    parser.add_argument("--recipe", required=True, help="the recipe file to benchmark, e.g. recipes/llama8b.py")
    parser.add_argument("--num_processes", type=int, default=8,
                        help="processes (GPUs) to launch (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5,
                        help=f"first steps left out of the figures (best a multiple of the {LOG_EVERY}-step logging "
                             "window; default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate trainer and bare-loop runs N times (default: %(default)s)")
    parser.add_argument("--timeout_s", type=float, default=3600,
                        help="stop a launch (and its ranks) that runs longer than this (default: %(default)s)")
    parser.add_argument("--levers", action="store_true",
                        help="one table: the plain path, each lever alone and the recommended combination")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # the worker side of the bare loop
    args = parser.parse_or_exit(argv)
    args.recipe_args = recipe_args
    problems = input_problems(args)
    for problem in problems:
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
    if problems:
        raise SystemExit(2)
    if args.bare:
        return bare_loop(args.recipe, args.steps, args.warmup, recipe_args)

    import torch

    if args.levers:
        return print(lever_table(args, torch.cuda.is_available()))

    # Launch-to-launch spread on a shared machine is larger than the difference measured: with --repeats, the
    # trainer and the bare loop run alternately and the medians are compared.
    trainer_runs, bare_runs = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as scratch:
            output_dir = Path(scratch) / "bench"
            launch(args, [args.recipe], output_dir)
            rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
        trainer_runs.append(summarize(rows, args.warmup))
        if not torch.cuda.is_available():
            bare_runs.append(run_bare(args, recipe_args))
    summary = {key: statistics.median(run[key] for run in trainer_runs) for key in trainer_runs[0]}
    for key, value in summary.items():
        print(f"{key:>30}: {value:,.4f}")
    if bare_runs:
        bare = statistics.median(bare_runs)
        ratio = summary["tokens_per_second_per_device"] / bare
        print(f"{'bare accelerate loop tokens/s':>30}: {bare:,.4f}")
        print(f"{'trainer / bare loop':>30}: {ratio:.3f}"
              + (f" (medians of {args.repeats}; per run: "
                 + ", ".join(f"{run['tokens_per_second_per_device'] / b:.3f}"
                             for run, b in zip(trainer_runs, bare_runs, strict=True)) + ")"
                 if args.repeats > 1 else ""))


def lever_rows(kind: str, shard: int, processes: int, mixed_precision: str, packing: bool, cuda: bool,
               capability: tuple[int, int] | None = None) -> list[tuple[str, tuple[str, ...], str]]:
    """(name, the recipe flags over the user's, why it cannot run here: '' when it can) for the plain path, each
    lever alone, and the recommended combination. `capability`: the GPU's compute capability, where known."""
    from shardtune.levers.catalogue import LEVERS, PLAIN_FLAGS, over

    rows = [("plain", PLAIN_FLAGS, "")]
    combined, names = PLAIN_FLAGS, []
    for lever in LEVERS:
        why = lever.runs(kind, shard, processes, mixed_precision, packing, cuda, capability)
        rows.append((lever.name, over(PLAIN_FLAGS, lever.flags), why))
        if lever.always and not why:
            combined = over(combined, lever.flags)
            names.append(lever.name)
    return [*rows, ("recommended: " + " + ".join(names), combined, "")]


def run_row(args: argparse.Namespace, flags: tuple[str, ...], cuda: bool) -> dict:
    """One launch of the recipe with `flags`: its summary, with `peak_mb` the peak memory of any rank."""
    with tempfile.TemporaryDirectory() as scratch:
        output_dir, memory = Path(scratch) / "bench", Path(scratch) / "memory"
        if not cuda:  # the profiler records the first steps only: inside the warm-up, outside the timed steps
            os.environ["SHARDTUNE_PROFILE_MEMORY"] = str(memory)
        try:
            launch(args, [args.recipe], output_dir, flags)
        finally:
            os.environ.pop("SHARDTUNE_PROFILE_MEMORY", None)
        rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
        summary = summarize(rows, args.warmup)
        if cuda:
            summary["peak_mb"] = summary["peak_memory_gb"] * 1e3
        else:
            ranks = [json.loads(path.read_text()) for path in memory.glob("memory_rank*.json")]
            summary["peak_mb"] = max(rank["peak"][phase] for rank in ranks
                                     for phase in ("forward_backward", "optimizer")) / 1e6
    return summary


def lever_table(args: argparse.Namespace, cuda: bool) -> str:
    """Launch every row of lever_rows and tabulate it against the plain path."""
    import torch

    from shardtune.flags import parse_recipe
    from shardtune.plan.strategy import read_accelerate_config

    spec = importlib.util.spec_from_file_location("bench_recipe", args.recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    recipe = parse_recipe(module.RECIPE, args.recipe_args)
    strategy = read_accelerate_config(args.config_file, recipe.mixed_precision)
    memory = "peak allocated on rank 0" if cuda else "peak live tensors, any rank"
    lines = [f"| lever | tokens/s per device | x plain | {memory} | x plain |", "|---|---|---|---|---|"]
    plain = None
    capability = torch.cuda.get_device_capability() if cuda else None
    for name, flags, why in lever_rows(strategy.kind, strategy.shard, args.num_processes, recipe.mixed_precision,
                                       recipe.packing, cuda, capability):
        if why:
            lines.append(f"| {name} | not run: {why} | | | |")
            continue
        try:
            summary = run_row(args, flags, cuda)
        except SystemExit as failed:  # one lever refused or failed: the table still shows the others
            lines.append(f"| {name} | failed: {failed} | | | |")
            continue
        plain = summary if name == "plain" else plain
        speed, peak = summary["tokens_per_second_per_device"], summary["peak_mb"]
        ratios = ((f"{speed / plain['tokens_per_second_per_device']:.2f}", f"{peak / plain['peak_mb']:.2f}")
                  if plain else ("", ""))
        lines.append(f"| {name} | {speed:,.1f} | {ratios[0]} | {peak:,.2f} MB | {ratios[1]} |")
    return "\n".join(lines)


def run_bare(args: argparse.Namespace, recipe_args: list[str]) -> float:
    """Tokens/s per device of the bare loop over the same recipe, model, data and batches."""
    bare_args = [__file__, "--bare", "--config_file", args.config_file, "--recipe", args.recipe,
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--"]
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", args.config_file,
               "--num_processes", str(args.num_processes), *bare_args, *recipe_args]
    out = run_launcher(command, args.timeout_s, capture=True)
    return json.loads(next(line for line in out.splitlines() if line.startswith("BARE "))[5:])[
        "tokens_per_second_per_device"]

if __name__ == "__main__":
    main()

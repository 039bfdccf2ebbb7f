"""Benchmark checkpoint saves: bytes, time until durable, and how long training stalls, synchronous against
asynchronous (--async_save), for DDP, FSDP and ZeRO-3, against this disk's own sequential write rate.

    python scripts/bench_checkpoint.py --dir /local_nvme/bench            # ~300M parameters, 2 ranks each

Each strategy runs under `accelerate launch` with the shipped config: a Llama of about --params parameters
(random weights) takes one training step, so that Adam's states exist, then saves its full training state
through shardtune's Checkpointer twice: synchronously, and asynchronously while training steps go on. The disk
rate is `dd ... conv=fdatasync` into the same directory, before and after the runs. Figures per strategy:

- bytes: the checkpoint's files (model, optimizer, scheduler and RNG states, every rank's shards);
- durable: seconds from the save's start until every rank's files are written and fsynced;
- write/disk: (bytes / durable) / the dd rate;
- stall: seconds the training loop was blocked in `save` (synchronous: all of it; asynchronous: the copy to
  host memory), and for asynchronous saves also `slower steps`: the extra time of the training steps that ran
  while the background write went on, against steps without one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardtune.checks.command_line import OneLineParser

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "fsdp_full_shard", "ds_zero3")
RESULT = "bench_checkpoint result: "


def disk_rate(directory: Path, megabytes: int) -> float:
    """Bytes per second of one sequential writer with fdatasync at the end, as dd reports it."""
    fd, target = tempfile.mkstemp(prefix="dd-", suffix=".bin", dir=directory)  # a new file: no one else's is written
    os.close(fd)
    try:
        result = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={max(1, megabytes // 16)}",
                                 "conv=fdatasync"], capture_output=True, text=True, check=True)
    finally:
        os.unlink(target)
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", result.stderr)
    return int(match.group(1)) / float(match.group(2))


def llama_config(params: float):
    """A Llama shape of roughly `params` parameters: hidden 1024, MLP 4096, 32k vocabulary, layers to fit."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 1024, 4096, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)


def worker(args: argparse.Namespace) -> None:
    """One strategy, under `accelerate launch`: prints one result line (JSON) on the main process."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import LlamaForCausalLM

    from shardtune.checkpoint.markers import complete_checkpoints, read_marker
    from shardtune.checkpoint.saver import Checkpointer
    from shardtune.config import BatchSizes, Recipe
    from shardtune.launch import LaunchDescription
    from shardtune.parallel.distributed import make_accelerator

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    recipe = Recipe(name="bench", use_cpu=not torch.cuda.is_available(), mixed_precision="no", save_steps=0,
                    save_total_limit=1, output_dir=str(args.dir / args.strategy), report_to="none")
    accelerator = make_accelerator(recipe, BatchSizes(1, 1, world_size), LaunchDescription.from_env(), log_with=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args.params))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tokens = torch.randint(0, model.config.vocab_size, (64, args.seq_len))
    loader = DataLoader(tokens, batch_size=1)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    batches = iter(loader)

    def train_step() -> float:
        started = time.perf_counter()
        batch = next(batches)
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        accelerator.wait_for_everyone()
        return time.perf_counter() - started

    train_step()  # Adam's states exist from here on
    step_s = statistics.median(train_step() for _ in range(args.steps))
    row = {"strategy": args.strategy, "params": params, "step_s": step_s}
    for mode in ("sync", "async"):
        recipe.async_save = mode == "async"
        recipe.output_dir = str(args.dir / args.strategy / mode)
        checkpointer = Checkpointer(accelerator, recipe, lambda path: None)
        # Asynchronous: the first save allocates the host buffers that later saves reuse; both are reported.
        for save in (1, 2) if mode == "async" else (1,):
            figures = timed_save(accelerator, checkpointer, save, train_step, step_s)
            (checkpoint,) = complete_checkpoints(recipe.output_dir)
            figures["bytes"] = sum(entry["bytes"] for entry in read_marker(checkpoint)["files"].values())
            row[mode if save == 1 and mode == "sync" else f"{mode}{save}"] = figures
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(recipe.output_dir)  # under the directory main made for this benchmark
    if accelerator.is_main_process:
        print(RESULT + json.dumps(row), flush=True)
    accelerator.end_training()


def timed_save(accelerator, checkpointer, step: int, train_step, step_s: float) -> dict:
    """Save at `step`, then train until the save is durable and marked."""
    started = time.perf_counter()
    checkpointer.save(step)
    stall = time.perf_counter() - started
    pending, extra, steps = checkpointer.pending, 0.0, 0
    while checkpointer.pending is not None:  # training goes on while the background write runs
        extra += train_step() - step_s
        steps += 1
        checkpointer.after_step(step, 10**9)
    durable = (pending.finished if pending else time.perf_counter()) - started
    return {"durable_s": max_over_ranks(accelerator, durable), "stall_s": max_over_ranks(accelerator, stall),
            "slower_steps_s": max_over_ranks(accelerator, extra), "steps_during_write": steps}


def max_over_ranks(accelerator, value: float) -> float:
    import torch

    return float(accelerator.reduce(torch.tensor([value], device=accelerator.device), reduction="max")[0])


def launch(args: argparse.Namespace, strategy: str) -> dict:
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(REPO / "accelerate_configs" / f"{strategy}.yaml"), "--num_processes", str(args.num_processes),
               __file__, "--worker", "--strategy", strategy, "--dir", str(args.dir), "--params", str(args.params),
               "--steps", str(args.steps), "--seq_len", str(args.seq_len)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT)]
    if result.returncode or not lines:
        raise SystemExit(f"bench_checkpoint: error: {strategy} failed (exit {result.returncode}):\n"
                         f"{result.stderr[-4000:]}")
    return json.loads(lines[0][len(RESULT):])


def table(rows: list[dict], rates: list[float]) -> str:
    rate = statistics.mean(rates)
    lines = [f"disk: dd bs=16M conv=fdatasync {rate / 1e6:,.0f} MB/s (before the runs {rates[0] / 1e6:,.0f}, "
             f"after {rates[-1] / 1e6:,.0f}); write rate / disk compares with the mean", "",
             "| strategy | params | bytes | save | durable s | write rate / disk | training stall s | stall / sync "
             "| steps while writing: extra s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for mode, label in (("sync", "sync"), ("async1", "async, first"), ("async2", "async, later")):
            figures = row[mode]
            write = figures["bytes"] / figures["durable_s"] / rate
            extra = f"{figures['steps_during_write']}: {figures['slower_steps_s']:.2f}" if mode != "sync" else "-"
            lines.append(f"| {row['strategy']} | {row['params'] / 1e6:,.0f}M | {figures['bytes'] / 1e9:.2f} GB | "
                         f"{label} | {figures['durable_s']:.2f} | {write:.0%} | {figures['stall_s']:.2f} | "
                         f"{figures['stall_s'] / row['sync']['stall_s']:.1%} | {extra} |")
    steps = ", ".join(f"{row['strategy']} {row['step_s']:.2f} s" for row in rows)
    lines.append(f"\nA training step without a save in flight: {steps}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None,
                        help="where checkpoints go, in a new directory of the benchmark's own, deleted at the end "
                             "(default: the working directory)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                        help="the shipped configs to run (default: all)")
    parser.add_argument("--params", type=float, default=300e6,
                        help="parameters of the random Llama saved (default: %(default).0e)")
    parser.add_argument("--num_processes", type=int, default=2, help="ranks per launch (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=2, help="training steps timed without a save in flight")
    parser.add_argument("--seq_len", type=int, default=64,
                        help="tokens per sequence of the training steps (default: %(default)s)")
    parser.add_argument("--dd_megabytes", type=int, default=2048, help="size of the dd write that rates the disk")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    args = parser.parse_or_exit(argv)
    if args.worker:
        worker(args)
        return 0
    parent = args.dir or Path(os.getcwd())
    parent.mkdir(parents=True, exist_ok=True)
    # Everything the benchmark writes goes into a new directory of its own inside --dir, deleted at the end: what
    # --dir held before is never written over or deleted.
    args.dir = Path(tempfile.mkdtemp(prefix=".bench_checkpoint-", dir=parent))
    try:
        rates, rows = [disk_rate(args.dir, args.dd_megabytes)], []  # before and after: the disk's rate drifts
        for strategy in args.strategies:
            rows.append(launch(args, strategy))
            print(f"bench_checkpoint: {strategy} done", file=sys.stderr, flush=True)
        rates.append(disk_rate(args.dir, args.dd_megabytes))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(table(rows, rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The shared training loop behind every recipe. Reads top to bottom: set-up, loop, eval, save."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import PeftModel
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from shardtune.checkpoint import save_checkpoint
from shardtune.config import BatchPlan, ConfigError, Recipe
from shardtune.data import IGNORE_INDEX, load_splits, make_collator
from shardtune.distributed import make_accelerator
from shardtune.flops import flops_per_token, mfu, shape_from_config
from shardtune.hardware import peak_flops
from shardtune.memory import COMPONENTS, ModelStateProbe
from shardtune.model import load_model, load_tokenizer
from shardtune.preemption import NON_FINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, StopRequest
from shardtune.ranks import check_ranks_agree, launch_fingerprint, set_collective_timeout, watch_ranks
from shardtune.tracking import log_metrics, peak_memory_gb, start_tracking, truncate_metrics


def train(recipe: Recipe, plan: BatchPlan, resume_path: str | None, start_step: int) -> None:
    """Train `recipe` (already checked by shardtune.cli), from `resume_path` at `start_step` if given. Every rank
    first checks that all ranks were launched alike, then trains watched by the others. Exits with the trainer's
    code when it stops early (non-finite loss, stop signal)."""
    stop = StopRequest()  # from the start: a signal during start-up still ends in a checkpoint and code 75
    accelerator = make_accelerator(recipe, plan, log_with="wandb" if recipe.report_to == "wandb" else None)
    machines = check_ranks_agree(accelerator, launch_fingerprint(accelerator, recipe, plan, start_step))
    with watch_ranks(accelerator, recipe, machines):
        exit_code = train_loop(accelerator, recipe, plan, resume_path, start_step, stop)
    accelerator.end_training()  # closes the trackers and the process group, once no rank watches the others
    if exit_code:
        sys.exit(exit_code)


def train_loop(accelerator: Accelerator, recipe: Recipe, plan: BatchPlan, resume_path: str | None,
               start_step: int, stop: StopRequest) -> int:
    output_dir = recipe.resolved_output_dir
    set_seed(recipe.seed)

    tokenizer = load_tokenizer(recipe)
    with accelerator.main_process_first():
        train_set, eval_set = load_splits(recipe, tokenizer)
    steps_per_epoch = len(train_set) // plan.global_batch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"The training split has {len(train_set)} rows, fewer than one global batch of {plan.global_batch}. "
            "Add data or lower --global_batch_size."
        )
    max_steps = recipe.max_steps if recipe.max_steps > 0 else steps_per_epoch * recipe.num_train_epochs

    model = load_model(recipe)
    flops_shape = shape_from_config(model.config, recipe.name)
    peak = peak_flops(torch.cuda.get_device_name(accelerator.device)) if torch.cuda.is_available() else None
    optimizer = torch.optim.AdamW(
        param_groups(model, recipe.weight_decay), lr=recipe.learning_rate,
        betas=(recipe.adam_beta1, recipe.adam_beta2), eps=recipe.adam_epsilon,
    )
    scheduler = get_scheduler(
        recipe.lr_scheduler_type, optimizer,
        num_warmup_steps=math.ceil(recipe.warmup_ratio * max_steps), num_training_steps=max_steps,
    )
    train_loader = DataLoader(train_set, batch_size=plan.micro_batch, shuffle=True, drop_last=True,
                              collate_fn=make_collator(tokenizer, packing=recipe.packing))
    eval_loader = DataLoader(eval_set, batch_size=recipe.per_device_eval_batch_size,
                             collate_fn=make_collator(tokenizer))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    if resume_path:
        started = time.perf_counter()
        accelerator.load_state(resume_path)
        accelerator.print(f"shardtune: resumed from {resume_path} at step {start_step} "
                          f"(state loaded in {time.perf_counter() - started:.1f}s)")
    elif recipe.overwrite_output_dir and accelerator.is_main_process:
        shutil.rmtree(output_dir, ignore_errors=True)
    accelerator.wait_for_everyone()
    set_collective_timeout(recipe.collective_timeout_minutes)  # start-up is over: a long wait now is a hang
    os.makedirs(output_dir, exist_ok=True)
    if accelerator.is_main_process:
        truncate_metrics(output_dir, after_step=start_step)  # a killed run may have logged past its checkpoint
    start_tracking(accelerator, recipe, resumed=resume_path is not None)
    accelerator.print(
        f"shardtune: {recipe.name} | {accelerator.distributed_type.value} x {plan.world_size} | "
        f"global batch {plan.global_batch} = {plan.micro_batch} x {plan.accumulation} accumulation x "
        f"{plan.world_size} ranks | {max_steps} steps | precision {recipe.mixed_precision}"
    )

    def save(step: int) -> None:
        def add_model_files(path: str) -> None:
            accelerator.unwrap_model(model).config.save_pretrained(path)
            tokenizer.save_pretrained(path)

        started = time.perf_counter()
        set_collective_timeout(recipe.startup_timeout_minutes)  # every shard written: as slow as the filesystem
        path = save_checkpoint(accelerator, output_dir, step, recipe.save_total_limit, add_model_files)
        set_collective_timeout(recipe.collective_timeout_minutes)
        accelerator.print(f"shardtune: saved {path} in {time.perf_counter() - started:.1f}s")

    probe = ModelStateProbe(model, optimizer)
    model.train()
    batches = global_batches(train_loader, plan, steps_per_epoch, start_step)
    window_loss = torch.zeros((), device=accelerator.device)
    window_tokens = torch.zeros(2, device=accelerator.device)  # sequence tokens, tokens processed (with padding)
    window_sequences = 0
    window_start, window_steps = time.perf_counter(), 0
    first_loss = last_loss = eval_metrics = None
    progress = tqdm(range(start_step + 1, max_steps + 1), initial=start_step, total=max_steps,
                    disable=not accelerator.is_main_process, desc="training")
    for step in progress:
        micro_batches = next(batches)
        # The loss of an update is (sum of all target-token losses of the global batch) / (their count), however
        # the batch is split over micro-batches and ranks: count the targets of the whole global batch first.
        targets = accelerator.reduce(count_targets(micro_batches), reduction="sum")
        step_loss = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):
                loss = model(**batch, num_items_in_batch=targets).loss  # this micro-batch's share of the mean
                # accelerate divides by the accumulation steps and the ranks average gradients: undo both.
                accelerator.backward(loss * plan.accumulation * plan.world_size)
                probe.after_backward()
            step_loss += loss.detach()
            window_tokens += count_tokens(batch)
            window_sequences += plan.micro_batch * plan.world_size  # packed batches are one row
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)  # only on the update
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        window_loss += step_loss
        window_steps += 1

        # One small all-reduce per step: any rank's non-finite loss or stop signal stops every rank together.
        grad_finite = grad_norm is None or math.isfinite(float(grad_norm))
        flags = torch.tensor([not torch.isfinite(step_loss) or not grad_finite, stop.requested], dtype=torch.float32)
        non_finite, stop_requested = (accelerator.reduce(flags.to(accelerator.device), reduction="sum") > 0).tolist()
        if non_finite:
            accelerator.print(f"shardtune: error: non-finite loss or gradient norm at step {step} "
                              f"(grad norm {float(grad_norm) if grad_norm is not None else 'n/a'}); nothing saved "
                              "from this state. Lower --learning_rate or resume from the last checkpoint.")
            return NON_FINITE_EXIT_CODE

        if step == start_step + 1:  # what the ranks really hold, to check against the planner's model states
            held = accelerator.gather(torch.tensor([probe.held[key] for key in COMPONENTS], dtype=torch.float64,
                                                   device=accelerator.device)).view(-1, len(COMPONENTS)).amax(0)
            held = {f"held_{key}_bytes": int(value) for key, value in zip(COMPONENTS, held.tolist(), strict=True)}
            accelerator.print("shardtune: held per rank (max over ranks): "
                              + ", ".join(f"{key[5:-6]} {value / 2**30:.3f} GiB" for key, value in held.items()))
            log_metrics(accelerator, output_dir, step, held)
        if step % recipe.logging_steps == 0 or step == max_steps:
            loss_sum, tokens, processed = accelerator.reduce(torch.cat([window_loss[None], window_tokens]),
                                                             reduction="sum").tolist()
            elapsed = time.perf_counter() - window_start
            metrics = {
                "loss": loss_sum / window_steps,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "tokens_per_second": tokens / elapsed,
                "tokens_per_second_per_device": tokens / elapsed / plan.world_size,
                "token_utilization": tokens / processed,  # padding wastes the rest
                "step_time_s": elapsed / window_steps,
                "epoch": step / steps_per_epoch,
                **peak_memory_gb(accelerator.device),
            }
            if peak:  # MFU as PaLM defines it; T is the mean sequence length of the window
                per_token = flops_per_token(flops_shape, seq_len=round(tokens / window_sequences))
                metrics["tflops_per_gpu"] = tokens / elapsed * per_token / plan.world_size / 1e12
                metrics["mfu"] = mfu(tokens / elapsed, per_token, plan.world_size, peak)
            progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                 tok_s=f"{metrics['tokens_per_second']:.0f}")
            log_metrics(accelerator, output_dir, step, metrics)
            first_loss = metrics["loss"] if first_loss is None else first_loss
            last_loss = metrics["loss"]
            window_loss.zero_(), window_tokens.zero_()
            window_start, window_steps, window_sequences = time.perf_counter(), 0, 0
        if stop_requested:
            save(step)
            accelerator.print(f"shardtune: stop signal received; checkpoint at step {step} saved, "
                              f"exiting with code {PREEMPTED_EXIT_CODE} (resume with --resume_from_checkpoint auto)",
                              flush=True)  # a requeue script reads it while the launchers shut down
            return PREEMPTED_EXIT_CODE
        if recipe.save_steps and (step % recipe.save_steps == 0 or step == max_steps):
            save(step)
        if step == max_steps or (recipe.eval_steps and step % recipe.eval_steps == 0):
            eval_metrics = evaluate(model, eval_loader, accelerator)
            accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
            log_metrics(accelerator, output_dir, step, eval_metrics)

    if first_loss is not None and eval_metrics is not None:
        accelerator.print(f"first loss {first_loss:.4f} | last loss {last_loss:.4f} | "
                          + " | ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
    if recipe.save_model:
        set_collective_timeout(recipe.startup_timeout_minutes)
        save_hf_model(accelerator, model, tokenizer, output_dir)
    return 0


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, not on norms and biases (by name: ZeRO-3 params have no real shape)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:  # a frozen PEFT base
            continue
        (no_decay if "norm" in name or name.endswith("bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]  # DeepSpeed drops empty groups (LoRA has no norms)


def global_batches(loader: DataLoader, plan: BatchPlan, steps_per_epoch: int, start_step: int = 0
                   ) -> Iterator[list[dict]]:
    """This rank's micro-batches of each optimizer step after `start_step`. The prepared loader deals
    micro-batches to ranks in turn, so one step covers `global_batch` consecutive rows of the epoch's seeded
    shuffle on any split. The epoch's tail that does not fill a global batch is skipped. A resumed run
    re-seeds the same epoch and skips the micro-batches already trained on, so it sees the same data."""
    epoch, done_in_epoch = divmod(start_step, steps_per_epoch)
    while True:
        loader.set_epoch(epoch)
        micro_batches = iter(loader)
        for _ in range(done_in_epoch * plan.accumulation):
            next(micro_batches)
        for _ in range(steps_per_epoch - done_in_epoch):
            yield [next(micro_batches) for _ in range(plan.accumulation)]
        epoch, done_in_epoch = epoch + 1, 0


def count_tokens(batch: dict) -> torch.Tensor:
    """(sequence tokens, tokens processed): padded batches carry an attention mask, packed ones no padding."""
    processed = batch["input_ids"].numel()
    real = batch["attention_mask"].sum() if "attention_mask" in batch else torch.tensor(processed)
    return torch.stack([real.to(torch.float32), torch.tensor(float(processed))]).to(real.device)


def count_targets(micro_batches: list[dict]) -> torch.Tensor:
    """Tokens that carry loss: labels shifted by one, as the causal LM loss compares them."""
    return sum((batch["labels"][:, 1:] != IGNORE_INDEX).sum() for batch in micro_batches)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
    """Mean loss and next-token accuracy over every target token of the held-out split, all ranks together."""
    model.eval()
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, targets, correct
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        mask = labels != IGNORE_INDEX
        token_loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        correct = (logits.argmax(-1) == labels) & mask
        per_row = torch.stack([token_loss.sum(1), mask.sum(1).float(), correct.sum(1).float()], dim=1)
        totals += accelerator.gather_for_metrics(per_row).sum(0)  # drops the rows padded in for even batches
    model.train()
    loss_sum, targets, correct = totals.tolist()
    return {"eval_loss": loss_sum / targets, "eval_accuracy": correct / targets}


def save_hf_model(accelerator: Accelerator, model: torch.nn.Module, tokenizer, output_dir: str) -> None:
    """Full weights gathered from FSDP / ZeRO-3 shards, written as safetensors by the main process. A PEFT
    model writes its adapter in peft's format, taken from the same gathered state dict (under ZeRO-3 the
    local adapter tensors are empty shards)."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        shards = {} if isinstance(unwrapped, PeftModel) else {"max_shard_size": "5GB"}
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True, **shards)
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()

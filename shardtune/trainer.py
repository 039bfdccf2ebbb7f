"""The shared training loop behind every recipe. Reads top to bottom: set-up, loop, eval, save."""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from shardtune.config import BatchPlan, ConfigError, Recipe, parse_recipe, validate
from shardtune.data import IGNORE_INDEX, load_splits, make_collator
from shardtune.distributed import launch_env, make_accelerator
from shardtune.model import load_model, load_tokenizer
from shardtune.tracking import log_metrics, peak_memory_gb, start_tracking


def main(recipe: Recipe, argv: list[str] | None = None) -> None:
    """Entry point of every recipe: command-line overrides, checks, training. Bad input: one line, exit 2."""
    # DeepSpeed still calls these collectives by their old names, once per layer and step.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    try:
        train(parse_recipe(recipe, argv))
    except ConfigError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"shardtune: error: {error}", file=sys.stderr)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(2)


def train(recipe: Recipe) -> None:
    world_size, uses_deepspeed, _ = launch_env()
    plan = validate(recipe, world_size, uses_deepspeed, has_gpu=torch.cuda.is_available())
    output_dir = recipe.resolved_output_dir
    accelerator = make_accelerator(recipe, plan, log_with="wandb" if recipe.report_to == "wandb" else None)
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
    optimizer = torch.optim.AdamW(
        param_groups(model, recipe.weight_decay), lr=recipe.learning_rate,
        betas=(recipe.adam_beta1, recipe.adam_beta2), eps=recipe.adam_epsilon,
    )
    scheduler = get_scheduler(
        recipe.lr_scheduler_type, optimizer,
        num_warmup_steps=math.ceil(recipe.warmup_ratio * max_steps), num_training_steps=max_steps,
    )
    collator = make_collator(tokenizer)
    train_loader = DataLoader(train_set, batch_size=plan.micro_batch, shuffle=True, drop_last=True, collate_fn=collator)
    eval_loader = DataLoader(eval_set, batch_size=recipe.per_device_eval_batch_size, collate_fn=collator)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    os.makedirs(output_dir, exist_ok=True)
    start_tracking(accelerator, recipe)
    accelerator.print(
        f"shardtune: {recipe.name} | {accelerator.distributed_type.value} x {plan.world_size} | "
        f"global batch {plan.global_batch} = {plan.micro_batch} x {plan.accumulation} accumulation x "
        f"{plan.world_size} ranks | {max_steps} steps | precision {recipe.mixed_precision}"
    )

    model.train()
    batches = global_batches(train_loader, plan, steps_per_epoch)
    window_loss = torch.zeros((), device=accelerator.device)
    window_tokens = torch.zeros((), device=accelerator.device)
    window_start, window_steps = time.perf_counter(), 0
    first_loss = last_loss = eval_metrics = None
    progress = tqdm(range(1, max_steps + 1), disable=not accelerator.is_main_process, desc="training")
    for step in progress:
        micro_batches = next(batches)
        # The loss of an update is (sum of all target-token losses of the global batch) / (their count), however
        # the batch is split over micro-batches and ranks: count the targets of the whole global batch first.
        targets = accelerator.reduce(count_targets(micro_batches), reduction="sum")
        for batch in micro_batches:
            with accelerator.accumulate(model):
                loss = model(**batch, num_items_in_batch=targets).loss  # this micro-batch's share of the mean
                # accelerate divides by the accumulation steps and the ranks average gradients: undo both.
                accelerator.backward(loss * plan.accumulation * plan.world_size)
            window_loss += loss.detach()
            window_tokens += batch["attention_mask"].sum()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)  # only on the update
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        window_steps += 1

        if step % recipe.logging_steps == 0 or step == max_steps:
            loss_sum, tokens = accelerator.reduce(torch.stack([window_loss, window_tokens]), reduction="sum").tolist()
            elapsed = time.perf_counter() - window_start
            metrics = {
                "loss": loss_sum / window_steps,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "tokens_per_second": tokens / elapsed,
                "tokens_per_second_per_device": tokens / elapsed / plan.world_size,
                "epoch": step / steps_per_epoch,
                **peak_memory_gb(accelerator.device),
            }
            progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                 tok_s=f"{metrics['tokens_per_second']:.0f}")
            log_metrics(accelerator, output_dir, step, metrics)
            first_loss = metrics["loss"] if first_loss is None else first_loss
            last_loss = metrics["loss"]
            window_loss.zero_(), window_tokens.zero_()
            window_start, window_steps = time.perf_counter(), 0
        if step == max_steps or (recipe.eval_steps and step % recipe.eval_steps == 0):
            eval_metrics = evaluate(model, eval_loader, accelerator)
            accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
            log_metrics(accelerator, output_dir, step, eval_metrics)

    accelerator.print(f"first loss {first_loss:.4f} | last loss {last_loss:.4f} | "
                      + " | ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
    if recipe.save_model:
        save_hf_model(accelerator, model, tokenizer, output_dir)
    accelerator.end_training()  # closes the trackers and the process group


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, not on norms and biases (by name: ZeRO-3 params have no real shape)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if "norm" in name or name.endswith("bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def global_batches(loader: DataLoader, plan: BatchPlan, steps_per_epoch: int) -> Iterator[list[dict]]:
    """This rank's micro-batches of each optimizer step. The prepared loader deals micro-batches to ranks in
    turn, so one step covers `global_batch` consecutive rows of the epoch's seeded shuffle on any split.
    The epoch's tail that does not fill a global batch is skipped."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        micro_batches = iter(loader)
        for _ in range(steps_per_epoch):
            yield [next(micro_batches) for _ in range(plan.accumulation)]
        epoch += 1


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
    """Full weights gathered from FSDP / ZeRO-3 shards, written as safetensors by the main process."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()

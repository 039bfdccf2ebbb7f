"""The shared training loop behind every recipe: build, then the loop on one screen, then export and eval.

The pieces it calls: `train_step` (shardtune.step) runs one optimizer step and returns device tensors;
`TrainMetrics` (shardtune.metrics) syncs once per step and keeps the logging window; the `Checkpointer`
(shardtune.checkpoint) decides when to save; `evaluate` (shardtune.evaluation) runs without fp32 logits.
"""

from __future__ import annotations

import copy
import gc
import os
import resource
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, fsdp2_prepare_model, set_seed
from peft import PeftModel
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, get_scheduler

from shardtune.checkpoint.durable import durable
from shardtune.checkpoint.saver import Checkpointer
from shardtune.config import BatchPlan, ConfigError, Recipe
from shardtune.data import load_splits, make_collator
from shardtune.distributed import exit_process, make_accelerator, reduction_dtypes, shut_down
from shardtune.evaluation import evaluate
from shardtune.flops import ModelShape, shape_from_config
from shardtune.generation import HeldOutPrompts, generate_samples, held_out_prompts
from shardtune.hardware import peak_flops
from shardtune.memory import COMPONENTS, ModelStateProbe, local_parameter_bytes
from shardtune.metrics import TrainMetrics
from shardtune.model import load_model, load_tokenizer
from shardtune.preemption import NON_FINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, Fault, StopRequest
from shardtune.profiling import begin_phase, end_phase, phase, profile_memory, start_phases
from shardtune.ranks import check_ranks_agree, launch_fingerprint, set_collective_timeout, watch_ranks
from shardtune.step import train_step, with_counts
from shardtune.tracking import log_metrics, log_samples, start_tracking, truncate_metrics


def train(recipe: Recipe, plan: BatchPlan, resume_path: str | None, start_step: int) -> NoReturn:
    """Train `recipe` (already checked by shardtune.cli), from `resume_path` at `start_step` if given. Every rank
    first checks that all ranks were launched alike, then trains watched by the others. Ends the process with the
    trainer's code: 0, or that of an early stop (non-finite loss, stop signal)."""
    stop = StopRequest()  # from the start: a signal during start-up still ends in a checkpoint and code 75
    accelerator = make_accelerator(recipe, plan, log_with="wandb" if recipe.report_to == "wandb" else None)
    machines = check_ranks_agree(accelerator, launch_fingerprint(accelerator, recipe, plan, start_step))
    with watch_ranks(accelerator, recipe, machines), profile_memory(accelerator.process_index):
        exit_code = train_loop(accelerator, recipe, plan, resume_path, start_step, stop)
    shut_down(accelerator)  # the wrappers, then the trackers and the process groups, once no rank watches
    exit_process(exit_code)


@dataclass
class Run:
    """Everything `build` makes, prepared by accelerate."""

    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: DataLoader
    eval_loader: DataLoader
    steps_per_epoch: int
    max_steps: int
    shape: ModelShape  # for FLOPs per token
    loaded: dict[str, int]  # parameter bytes right after loading; peak RSS while loading and sharding
    held_out: HeldOutPrompts | None  # the prompts answered at each eval (--generation_samples)
    save_dtype: torch.dtype | None  # of the Hugging Face export; None: as trained


def build(accelerator: Accelerator, recipe: Recipe, plan: BatchPlan) -> Run:
    set_seed(recipe.seed)
    tokenizer = load_tokenizer(recipe)
    with accelerator.local_main_process_first():  # once per node: nodes need not share the datasets cache
        train_set, eval_set = load_splits(recipe, tokenizer)
    steps_per_epoch = len(train_set) // plan.global_batch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"The training split has {len(train_set)} rows, fewer than one global batch of {plan.global_batch}. "
            "Add data or lower --global_batch_size."
        )
    max_steps = recipe.max_steps if recipe.max_steps > 0 else steps_per_epoch * recipe.num_train_epochs

    rss_before = rss_bytes()
    reset_peak_rss()  # so that the peaks read below are the loading's own
    model = load_model(recipe, main_process=accelerator.is_main_process)
    # Host RAM the weights took while loading (before any move to a GPU): the planner's model_loading per process.
    loaded = {"parameter_bytes": local_parameter_bytes(model), "loading_rss_bytes": peak_rss_bytes() - rss_before}
    shape = shape_from_config(model.config, recipe.name)
    if accelerator.distributed_type == DistributedType.FSDP:
        # Shard first (accelerate's own FSDP2 preparation; `prepare` below finds the model sharded) and build the
        # optimizer on the shards: the ranks that loaded no weights hold meta parameters, which all share
        # data_ptr 0, the key by which `prepare` would map the optimizer's parameters to the sharded ones.
        model = fsdp2_prepare_model(accelerator, model)
    optimizer = torch.optim.AdamW(
        param_groups(model, recipe.weight_decay), lr=recipe.learning_rate,
        betas=(recipe.adam_beta1, recipe.adam_beta2), eps=recipe.adam_epsilon,
    )
    scheduler = get_scheduler(
        recipe.lr_scheduler_type, optimizer,
        num_warmup_steps=recipe.warmup_steps_for(max_steps), num_training_steps=max_steps,
    )
    train_loader = DataLoader(train_set, batch_size=plan.micro_batch, shuffle=True, drop_last=True,
                              collate_fn=make_collator(tokenizer, recipe.packing, recipe.attn_implementation))
    eval_loader = DataLoader(eval_set, batch_size=recipe.per_device_eval_batch_size,
                             collate_fn=make_collator(tokenizer))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    loaded["peak_rss_bytes"] = peak_rss_bytes()  # loading and sharding: FSDP reads rank 0's copy only now
    return Run(tokenizer, model, optimizer, scheduler, train_loader, eval_loader, steps_per_epoch, max_steps, shape,
               loaded, held_out_prompts(eval_set, recipe.generation_samples, recipe.max_seq_length),
               export_dtype(recipe))


def train_loop(accelerator: Accelerator, recipe: Recipe, plan: BatchPlan, resume_path: str | None,
               start_step: int, stop: StopRequest) -> int:
    run = build(accelerator, recipe, plan)
    model, optimizer, scheduler, output_dir = run.model, run.optimizer, run.scheduler, recipe.resolved_output_dir
    start(accelerator, recipe, plan, run, resume_path, start_step)
    checkpointer = Checkpointer(accelerator, recipe, lambda path: add_model_files(accelerator, run, path))
    on_gpu = accelerator.device.type == "cuda"
    peak = peak_flops(torch.cuda.get_device_name(accelerator.device)) if on_gpu else None
    metrics = TrainMetrics(accelerator, plan, run.steps_per_epoch, run.shape, peak)
    probe, fault = ModelStateProbe(model, optimizer), Fault.from_env(accelerator.process_index)
    start_phases(model, optimizer)  # SHARDTUNE_PROFILE_MEMORY: peaks per phase (shardtune.profiling)

    def after_backward(micro_batch: int) -> None:  # the first step's memory probe; a fault a test injects
        probe.after_backward()
        if fault is not None:
            fault.after_backward(step, micro_batch)

    steps = with_counts(global_batches(run.train_loader, plan, run.steps_per_epoch, start_step))
    first_loss = last_loss = None
    model.train()
    progress = tqdm(range(start_step + 1, run.max_steps + 1), initial=start_step, total=run.max_steps,
                    disable=not accelerator.is_main_process, desc="training")
    for step, (micro_batches, counts, next_counts) in zip(progress, steps, strict=False):  # batches never end
        begin_phase("forward_backward")
        out = train_step(accelerator, model, optimizer, scheduler, micro_batches, counts,
                         metrics.global_targets(counts), plan, recipe.max_grad_norm, after_backward)
        end_phase()
        summary = metrics.after_step(out, stop.requested, next_counts)  # every rank's verdict reaches every rank
        if summary.non_finite:
            accelerator.print(f"shardtune: error: non-finite loss or gradient norm at step {step} "
                              f"(loss {summary.loss}, grad norm {summary.grad_norm}); nothing saved from this "
                              "state. Lower --learning_rate or resume from the last checkpoint.")
            return NON_FINITE_EXIT_CODE
        if step == start_step + 1:
            report_held(accelerator, output_dir, step, probe, run.loaded)
        if step % recipe.logging_steps == 0 or step == run.max_steps:
            row = metrics.window(step, summary, scheduler.get_last_lr()[0])
            progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}",
                                 tok_s=f"{row['tokens_per_second']:.0f}")
            log_metrics(accelerator, output_dir, step, row)
            first_loss, last_loss = first_loss if first_loss is not None else row["loss"], row["loss"]
        if summary.stop_requested:
            checkpointer.save(step)
            checkpointer.wait()
            accelerator.print(f"shardtune: stop signal received; checkpoint at step {step} saved, "
                              f"exiting with code {PREEMPTED_EXIT_CODE} (resume with --resume_from_checkpoint auto)",
                              flush=True)  # a requeue script reads it while the launchers shut down
            return PREEMPTED_EXIT_CODE
        checkpointer.after_step(step, run.max_steps)
        if recipe.eval_steps and step % recipe.eval_steps == 0 and step < run.max_steps:
            log_eval(accelerator, run, output_dir, step)

    checkpointer.wait()
    if recipe.save_model:  # before the final eval: an eval that fails must not cost the trained model
        set_collective_timeout(recipe.startup_timeout_minutes)
        with phase("save"):
            save_hf_model(accelerator, model, run.tokenizer, output_dir, run.save_dtype)
        set_collective_timeout(recipe.collective_timeout_minutes)
    eval_metrics = log_eval(accelerator, run, output_dir, run.max_steps)
    if first_loss is not None:
        accelerator.print(f"first loss {first_loss:.4f} | last loss {last_loss:.4f} | "
                          + " | ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
    return 0


def start(accelerator: Accelerator, recipe: Recipe, plan: BatchPlan, run: Run, resume_path: str | None,
          start_step: int) -> None:
    """Restore a checkpoint or clear an earlier run, lower the collective timeout, start tracking."""
    output_dir = recipe.resolved_output_dir
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
        f"{plan.world_size} ranks | {run.max_steps} steps | precision {recipe.mixed_precision} "
        f"{reduction_dtypes(run.model)}".rstrip()
    )


def log_eval(accelerator: Accelerator, run: Run, output_dir: str, step: int) -> dict[str, float]:
    with phase("eval"):
        eval_metrics = evaluate(run.model, run.eval_loader, accelerator)
    accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
    log_metrics(accelerator, output_dir, step, eval_metrics)
    if run.held_out is not None:  # under ZeRO-3 / FSDP one full parameter gather per token: the time is shown
        started = time.perf_counter()
        samples = generate_samples(accelerator, run.model, run.tokenizer, run.held_out)
        accelerator.print(f"step {step}: {len(samples)} samples generated in {time.perf_counter() - started:.1f}s "
                          f"(samples.jsonl)")
        log_samples(accelerator, output_dir, step, samples)
    return eval_metrics


def report_held(accelerator: Accelerator, output_dir: str, step: int, probe: ModelStateProbe,
                loaded: dict[str, int]) -> None:
    """What the ranks really held at the first step (checked against the planner's model states: max over
    ranks), and per rank what it held right after loading the weights (only rank 0 reads them under FSDP)."""
    loading = ("parameter_bytes", "peak_rss_bytes", "loading_rss_bytes")
    local = [probe.held[key] for key in COMPONENTS] + [loaded[key] for key in loading]
    per_rank = accelerator.gather(torch.tensor(local, dtype=torch.float64, device=accelerator.device))
    per_rank = per_rank.view(-1, len(local)).tolist()
    held = {f"held_{key}_bytes": int(max(rank[index] for rank in per_rank)) for index, key in enumerate(COMPONENTS)}
    for rank, values in enumerate(per_rank):
        held.update({f"loaded_{key}_rank{rank}": int(value) for key, value in zip(loading, values[-3:], strict=True)})
    accelerator.print("shardtune: held per rank (max over ranks): "
                      + ", ".join(f"{key} {held[f'held_{key}_bytes'] / 2**30:.3f} GiB" for key in COMPONENTS))
    log_metrics(accelerator, output_dir, step, held)


def reset_peak_rss() -> None:
    """Start this process's peak resident set size (VmHWM) afresh from the current size (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:  # not Linux: the peak then counts from the start of the process
        pass


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS; 0 where /proc is missing)."""
    return _proc_status_bytes("VmRSS:") or 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size since the last `reset_peak_rss` (VmHWM; where /proc is missing, the
    peak since the process started)."""
    peak = _proc_status_bytes("VmHWM:")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as file:
            return next(int(line.split()[1]) * 1024 for line in file if line.startswith(field))
    except OSError:
        return None


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


def add_model_files(accelerator: Accelerator, run: Run, path: str) -> None:
    """The config and tokenizer beside a checkpoint's state, so that it exports on its own. The config states
    the export's dtype (scripts/export_hf.py writes that by default), not the fp32 of the master weights."""
    config_with_dtype(accelerator.unwrap_model(run.model).config, run.save_dtype).save_pretrained(path)
    run.tokenizer.save_pretrained(path)


# --save_dtype (shardtune.config.SAVE_DTYPES, less auto) as torch dtypes.
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_dtype(recipe: Recipe) -> torch.dtype | None:
    """--save_dtype: bf16 / fp16 / fp32, or auto: the dtype the model's own config.json states (bf16 for the
    Llama recipes). The loaded model's config says fp32 (full fine-tuning loads fp32 master weights), so auto
    reads the original. None (export as trained) where it states none."""
    if recipe.save_dtype != "auto":
        return EXPORT_DTYPES[recipe.save_dtype]
    from transformers import AutoConfig

    stated = AutoConfig.from_pretrained(recipe.model_name_or_path).dtype
    return getattr(torch, stated) if isinstance(stated, str) else stated


def cast_floating(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating-point tensors to `dtype`, in place, one at a time: a full state dict the gather made (FSDP's,
    on the host) frees each fp32 tensor as its cast replaces it, so the peak is one copy plus one tensor."""
    if dtype is not None:
        for key, tensor in state_dict.items():
            if tensor.is_floating_point() and tensor.dtype != dtype:
                state_dict[key] = tensor.to(dtype)
    return state_dict


def config_with_dtype(config, dtype: torch.dtype | None):
    """A copy of the model config that states `dtype` (config.json's "dtype"); the live config is untouched."""
    if dtype is None:
        return config
    config = copy.deepcopy(config)
    config.dtype = str(dtype).removeprefix("torch.")
    return config


def save_hf_model(accelerator: Accelerator, model: torch.nn.Module, tokenizer, output_dir: str,
                  dtype: torch.dtype | None = None) -> None:
    """Full weights gathered from FSDP / ZeRO-3 shards, cast to `dtype` (None: as trained), written as
    safetensors by the main process, with a config.json that states the dtype written. A PEFT model writes its
    adapter in peft's format, as trained (fp32 adapters: small, and peft upcasts them on load anyway), taken
    from the same gathered state dict (under ZeRO-3 the local adapter tensors are empty shards)."""
    state_dict = accelerator.get_state_dict(model)  # ZeRO-3: on the main process only (None elsewhere)
    masters = {}
    if dtype == torch.float32 and deepspeed_half(accelerator):
        masters = deepspeed_master_weights(accelerator, model)  # a collective: every rank takes part
    if accelerator.is_main_process:
        state_dict.update(masters)
        unwrapped = accelerator.unwrap_model(model)
        if isinstance(unwrapped, PeftModel):
            unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        else:
            # save_pretrained writes the dtype of the live parameters into config.json; the copy states the cast.
            unwrapped.save_pretrained(output_dir, state_dict=cast_floating(state_dict, dtype),
                                      safe_serialization=True, max_shard_size="5GB")
            config_with_dtype(unwrapped.config, dtype).save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        durable(output_dir, recursive=False)  # the export's files, then output_dir itself, survive a crash
    # The gathered copies sit in reference cycles that outlive this call until the collector runs: measured, a
    # bf16 ZeRO-3 run's fp32 masters (4 bytes x P on the host) were still alive through the final eval.
    del state_dict, masters
    gc.collect()
    accelerator.wait_for_everyone()


def deepspeed_half(accelerator: Accelerator) -> bool:
    """DeepSpeed in bf16 / fp16: its module holds 16-bit weights, the fp32 master weights are the optimizer's."""
    return accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.mixed_precision in ("bf16", "fp16")


def deepspeed_master_weights(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 master weights of the trained parameters, assembled one parameter at a time from the ranks'
    partitions (a collective under every ZeRO stage: all ranks walk the parameters in the same order); on the
    main process, on the host. An fp32 export of a bf16 DeepSpeed run holds these, not upcast 16-bit weights."""
    from deepspeed.utils import safe_get_full_fp32_param

    weights = {}
    for name, param in accelerator.unwrap_model(model).named_parameters():
        full = safe_get_full_fp32_param(param)  # None for frozen parameters: their 16-bit value stays
        if full is not None and accelerator.is_main_process:
            weights[name] = full.detach().cpu()
    return weights

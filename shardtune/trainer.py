"""The shared training loop behind every recipe: build, then the loop on one screen, then export and eval.

The pieces it calls: `train_step` (shardtune.step) runs one optimizer step and returns device tensors and the
rate the step used; `TrainMetrics` (shardtune.metrics) syncs once per step and keeps the logging window; the
`Checkpointer` (shardtune.checkpoint.saver) decides when to save; `evaluate` (shardtune.evaluation) runs without
fp32 logits; `save_hf_model` (shardtune.export.model) writes the trained model; `report_held` and `log_window`
(shardtune.tracking) report the first step and each logging window.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, fsdp2_prepare_model, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from shardtune.checkpoint.nvme_resume import load_state
from shardtune.checkpoint.preemption import NON_FINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, Fault, StopRequest
from shardtune.checkpoint.run_files import clear_output_dir
from shardtune.checkpoint.run_settings import ResumePoint, check_resumed_length, run_settings
from shardtune.checkpoint.saver import Checkpointer
from shardtune.checkpoint.universal import universal_checkpoint
from shardtune.config import BatchSizes, ConfigError, Recipe, token_multiple
from shardtune.data.batches import RowTrace, counted_steps, global_batches, make_collator
from shardtune.data.loading import load_splits
from shardtune.data.packing import pack_rows
from shardtune.evaluation import evaluate
from shardtune.export.model import add_model_files, export_dtype, save_hf_model
from shardtune.generation import HeldOutPrompts, generate_samples, held_out_prompts
from shardtune.launch import LaunchDescription
from shardtune.levers.compile import compile_decoder_layers, compile_figures, eager_calls
from shardtune.levers.float8 import (
    convert_linears,
    precompute_scales_after_step,
    rewrap_loaded_shards,
    unfused_fp8_warning,
)
from shardtune.levers.liger import apply_liger_kernels
from shardtune.levers.optimizers import make_optimizer
from shardtune.memory import (
    ModelStateProbe,
    local_parameter_bytes,
    peak_rss_bytes,
    phase_peak_gb,
    reset_peak_rss,
    reset_phase_peak,
    rss_bytes,
)
from shardtune.methods.dpo import evaluate_pairs
from shardtune.methods.dpo_loss import PAIR_METRICS
from shardtune.methods.pair_batches import PreferenceCollator, numbered
from shardtune.methods.reference import disable_dropout
from shardtune.methods.training import DPOTraining
from shardtune.metrics import MAX_SKIPPED_IN_A_ROW, StepSummary, TrainMetrics, device_peak_flops
from shardtune.model import enable_activation_offloading, load_model, load_tokenizer
from shardtune.models.flops import ModelShape, shape_from_config
from shardtune.parallel.context import row_multiple
from shardtune.parallel.distributed import (
    exit_process,
    make_accelerator,
    optimizer_parameter_names,
    reduction_dtypes,
    repoint_optimizer_parameters,
    shut_down,
)
from shardtune.parallel.ranks import (
    SHARED_DIR_PATIENCE_S,
    check_output_dir_shared,
    check_ranks_agree,
    launch_fingerprint,
    set_collective_timeout,
    watch_ranks,
)
from shardtune.parallel.sequence import check_right_padding, plain_loader, sequence_split, split_in_eval
from shardtune.parallel.tensor import (
    apply_tensor_parallel,
    prepare_without_tp,
    rank0_full_state,
    shard_and_fill,
    tensor_parallel_size,
)
from shardtune.plan.planned_run import recipe_peft
from shardtune.profiling import begin_phase, end_phase, phase, profile_memory, start_phases
from shardtune.step import train_step
from shardtune.tracking import (
    log_metrics,
    log_samples,
    log_window,
    report_compiled,
    report_held,
    start_tracking,
    truncate_metrics,
)


def train(recipe: Recipe, batching: BatchSizes, launch: LaunchDescription, resume: ResumePoint) -> NoReturn:
    """Train `recipe` (already checked by shardtune.cli), from the checkpoint `resume` names if any. Every rank
    first checks that all ranks were launched alike, then trains watched by the others. Ends the process with the
    trainer's code: 0, or that of an early stop (non-finite loss, stop signal)."""
    stop = StopRequest()  # from the start: a signal during start-up still ends in a checkpoint and code 75
    accelerator = make_accelerator(recipe, batching, launch, log_with="wandb" if recipe.report_to == "wandb" else None)
    machines = check_ranks_agree(accelerator, launch_fingerprint(accelerator, recipe, batching, launch, resume.step))
    # within the start-up collective timeout, so that every rank reaches the verdicts' all-gather
    check_output_dir_shared(recipe.resolved_output_dir, machines,
                            min(SHARED_DIR_PATIENCE_S, recipe.startup_timeout_minutes * 60 / 2))
    with watch_ranks(accelerator, recipe, machines), profile_memory(accelerator.process_index):
        exit_code = train_loop(accelerator, recipe, batching, launch, resume, stop)
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
    dpo: DPOTraining | None = None  # --method dpo: its step, reference and precomputation


def build(accelerator: Accelerator, recipe: Recipe, batching: BatchSizes, resume: ResumePoint | None = None,
          sp_size: int = 1, cp_size: int = 1) -> Run:
    set_seed(recipe.seed)
    tokenizer = load_tokenizer(recipe)
    if sp_size > 1 or cp_size > 1:
        check_right_padding(tokenizer)
    with accelerator.local_main_process_first():  # once per node: nodes need not share the datasets cache
        train_set, eval_set = load_splits(recipe, tokenizer)
        train_set = pack_rows(train_set, recipe)  # here, not in load_splits: prepare_data.py saves sequences
    if recipe.method == "dpo":  # each pair numbered: its precomputed reference log-probs are found by it
        train_set, eval_set = numbered(train_set), numbered(eval_set)
    steps_per_epoch = len(train_set) // batching.global_batch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"The training split has {len(train_set)} rows, fewer than one global batch of {batching.global_batch}. "
            "Add data or lower --global_batch_size."
        )
    max_steps = recipe.max_steps if recipe.max_steps > 0 else steps_per_epoch * recipe.num_train_epochs
    if resume and resume.path:  # before the weights load: a run's length from its epochs follows the data's
        check_resumed_length(resume.path, resume.saved, max_steps)

    rss_before = rss_bytes()
    reset_peak_rss()  # so that the peaks read below are the loading's own
    model = load_model(recipe, main_process=accelerator.is_main_process)
    if recipe.method == "dpo":
        disable_dropout(model)  # TRL's default: the policy's log-probs start where the reference's are
    # Host RAM the weights took while loading (before any move to a GPU): the planner's model_loading per process.
    loaded = {"parameter_bytes": local_parameter_bytes(model), "loading_rss_bytes": peak_rss_bytes() - rss_before}
    shape = shape_from_config(model.config, recipe.name)
    if recipe.use_liger_kernel:  # before sharding: the wrappers find the patched modules' forwards in place
        apply_liger_kernels(model)
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    full_state = None  # TP under rank-0 loading: rank 0's whole weights, filled into the shards after sharding
    if tensor_parallel_size(accelerator) > 1:  # before sharding: FSDP2 shards each rank's slices over the data ranks
        if fsdp and accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
            full_state = rank0_full_state(model, accelerator.is_main_process)
        apply_tensor_parallel(model, accelerator.torch_device_mesh["tp"])
    if recipe.mixed_precision == "fp8":  # before sharding: FSDP2 then gathers the wrapped weights in float8
        convert_linears(model, all_gather=fsdp)
    if fsdp:
        # Shard first (accelerate's own FSDP2 preparation; `prepare` below finds the model sharded) and build the
        # optimizer on the shards: the ranks that loaded no weights hold meta parameters, which all share
        # data_ptr 0, the key by which `prepare` would map the optimizer's parameters to the sharded ones.
        model = fsdp2_prepare_model(accelerator, model) if full_state is None else \
            shard_and_fill(accelerator, model, full_state)
        if recipe.mixed_precision == "fp8":
            rewrap_loaded_shards(model)
    # torch AdamW's fused kernel on CUDA (TrainingArguments' default); DeepSpeed steps its flat partitions as before.
    fused = accelerator.device.type == "cuda" and accelerator.distributed_type != DistributedType.DEEPSPEED
    optimizer, scheduler = make_optimizer(model, recipe, max_steps, fused=fused)
    if recipe.mixed_precision == "fp8" and fsdp:
        precompute_scales_after_step(optimizer, model)
    if recipe.torch_compile:  # in place: the wrappers `prepare` adds find the layers' hooks where they were
        compile_decoder_layers(model, recipe)
    # Under the sequence split every rank takes an equal slice of each micro-batch's length, by position, and no
    # attention mask reaches a kernel (shardtune.parallel.sequence); under context parallelism two chunks of it.
    multiple, split = math.lcm(token_multiple(recipe), sp_size, row_multiple(cp_size)), sp_size > 1
    unmasked = split or cp_size > 1
    if recipe.method == "dpo":
        train_collate, eval_collate = (PreferenceCollator(tokenizer.pad_token_id, recipe.max_seq_length, multiple)
                                       for _ in range(2))
    else:
        train_collate = make_collator(tokenizer, recipe.packing, recipe.attn_implementation, multiple, unmasked)
        eval_collate = make_collator(tokenizer, multiple=multiple, unmasked=unmasked)
    train_loader = DataLoader(train_set, batch_size=batching.micro_batch, shuffle=True, drop_last=True,
                              collate_fn=train_collate)
    eval_loader = DataLoader(eval_set, batch_size=recipe.per_device_eval_batch_size, collate_fn=eval_collate)
    stepped = optimizer_parameter_names(optimizer, model)
    with prepare_without_tp(accelerator):
        model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, eval_loader, scheduler
        )
    if fsdp:
        repoint_optimizer_parameters(optimizer, model, stepped)
    if split:  # accelerate wrapped both loaders in DeepSpeed's adapter: the step cuts its micro-batches itself
        train_loader, eval_loader = plain_loader(train_loader), plain_loader(eval_loader)
        split_in_eval()
    loaded["peak_rss_bytes"] = peak_rss_bytes()  # loading and sharding: FSDP reads rank 0's copy only now
    if recipe.activation_offloading:  # on the prepared model: TRL's manager skips its (sharded) parameters
        enable_activation_offloading(model)
    dpo = DPOTraining.build(accelerator, recipe, model, {"train": (train_set, train_collate, batching.micro_batch),
                                                          "eval": (eval_set, eval_collate,
                                                                   recipe.per_device_eval_batch_size)}) \
        if recipe.method == "dpo" else None
    return Run(tokenizer, model, optimizer, scheduler, train_loader, eval_loader, steps_per_epoch, max_steps, shape,
               loaded, held_out_prompts(eval_set, recipe.generation_samples, recipe.max_seq_length),
               export_dtype(recipe), dpo)


class BackwardHooks:
    """What runs after each micro-batch's backward: the first step's memory probe, and the fault a test injects
    (SHARDTUNE_FAULT, shardtune.checkpoint.preemption) at a chosen step and micro-batch. The loop sets `step`."""

    def __init__(self, probe: ModelStateProbe, fault: Fault | None) -> None:
        self.probe, self.fault = probe, fault
        self.step = 0  # the optimizer step running

    def after_backward(self, micro_batch: int) -> None:
        self.probe.after_backward()
        if self.fault is not None:
            self.fault.after_backward(self.step, micro_batch)


def train_loop(accelerator: Accelerator, recipe: Recipe, batching: BatchSizes, launch: LaunchDescription,
               resume: ResumePoint, stop: StopRequest) -> int:
    run = build(accelerator, recipe, batching, resume, launch.sp_size, launch.cp_size)
    start_step = resume.step
    model, output_dir = run.model, recipe.resolved_output_dir
    # SHARDTUNE_PROFILE_MEMORY: peaks per phase (shardtune.profiling), from DPO's reference pass in `start` on
    start_phases(model, run.optimizer)
    start(accelerator, recipe, batching, launch, run, resume)
    checkpointer = Checkpointer(accelerator, recipe,
                                lambda path: add_model_files(accelerator, model, run.tokenizer, run.save_dtype, path),
                                {**run_settings(recipe, launch, batching), "max_steps": run.max_steps})
    peft = recipe_peft(recipe)
    metrics = TrainMetrics(accelerator, batching, run.steps_per_epoch, run.shape, device_peak_flops(accelerator),
                           # a DeepSpeed JSON's own fp16 setting wins over the recipe's precision
                           loss_scaled=launch.strategy(recipe.mixed_precision).mixed_precision == "fp16",
                           adapters=peft.trainable_params(run.shape) if peft else None,
                           method_metrics=PAIR_METRICS if run.dpo else ())
    split = sequence_split(launch.sp_size, launch.deepspeed_settings)
    hooks = BackwardHooks(ModelStateProbe(model, run.optimizer), Fault.from_env(accelerator.process_index))
    rows = RowTrace.from_env(accelerator.process_index)

    steps = counted_steps(global_batches(run.train_loader, batching, run.steps_per_epoch, start_step))
    model.train()
    progress = tqdm(range(start_step + 1, run.max_steps + 1), initial=start_step, total=run.max_steps,
                    disable=not accelerator.is_main_process, desc="training")
    for step, batch in zip(progress, steps, strict=False):  # batches never end
        hooks.step = step
        rows.record(step, batch.micro_batches)
        begin_phase("forward_backward")
        out = train_step(accelerator, model, run.optimizer, run.scheduler, batch.micro_batches,
                         metrics.global_targets(batch), batching, recipe.max_grad_norm, hooks.after_backward,
                         # the tiles would replace the head's forward, which TP wraps (shardtune.parallel.tensor)
                         chunked_cross_entropy=recipe.chunked_cross_entropy and launch.tp_size == 1,
                         fused_loss=recipe.use_liger_kernel,
                         sequence_split=split, method=run.dpo.step if run.dpo else None,
                         context_size=launch.cp_size)
        end_phase()
        summary = metrics.after_step(out, batch, stop.requested)  # every rank's verdict reaches every rank
        if summary.non_finite:
            checkpointer.wait()  # a save still being written is of an earlier, finite step: it completes
            return refuse_non_finite(accelerator, step, summary, metrics.loss_scaled)
        if step == start_step + 1:
            report_held(accelerator, output_dir, step, hooks.probe, run.loaded)
            if recipe.torch_compile:
                report_compiled(accelerator, recipe)
        if step % recipe.logging_steps == 0 or step == run.max_steps:
            row = metrics.window(step, summary, lr=out.lr)
            if recipe.torch_compile:  # the count stays put once every shape the run meets has its graph
                row.update(compile_figures(accelerator))
            log_window(accelerator, output_dir, step, row, progress)
        if summary.stop_requested:
            return save_and_stop(accelerator, checkpointer, step)
        if checkpointer.due(step, run.max_steps):
            with metrics.paused() as saving:  # tokens/s and the window's peak are training's
                checkpointer.after_step(step, run.max_steps)
            log_metrics(accelerator, output_dir, step, {f"checkpoint_{name}": gb for name, gb in saving.items()})
        else:
            checkpointer.after_step(step, run.max_steps)  # polls a save in flight
        if recipe.eval_steps and step % recipe.eval_steps == 0 and step < run.max_steps:
            with metrics.paused():  # the eval logs its own peak
                log_eval(accelerator, run, output_dir, step)
    return finish(accelerator, recipe, run, checkpointer, metrics)


def start(accelerator: Accelerator, recipe: Recipe, batching: BatchSizes, launch: LaunchDescription, run: Run,
          resume: ResumePoint) -> None:
    """Restore a checkpoint or clear an earlier run, lower the collective timeout, start tracking."""
    output_dir = recipe.resolved_output_dir
    if not resume.path and recipe.overwrite_output_dir and accelerator.is_main_process:
        clear_output_dir(output_dir)  # all but the lock this run holds
    accelerator.wait_for_everyone()
    if run.dpo is not None:  # before a checkpoint loads: the policy as loaded is the reference
        run.dpo.precompute(accelerator, recipe)
    if resume.path:
        started = time.perf_counter()
        # a DeepSpeed checkpoint of another world size: its universal form, converted once
        path = universal_checkpoint(accelerator, resume.path, output_dir) if resume.universal else resume.path
        load_state(accelerator, path, universal=resume.universal)
        accelerator.print(f"shardtune: resumed from {resume.path} at step {resume.step} "
                          f"(state loaded in {time.perf_counter() - started:.1f}s)"
                          + "".join(f"; {note}" for note in resume.notes))
    set_collective_timeout(recipe.collective_timeout_minutes)  # start-up is over: a long wait now is a hang
    os.makedirs(output_dir, exist_ok=True)
    if accelerator.is_main_process:
        truncate_metrics(output_dir, after_step=resume.step)  # a killed run may have logged past its checkpoint
    start_tracking(accelerator, recipe, launch, resumed=resume.path is not None)
    accelerator.print(
        f"shardtune: {recipe.name} | {run.dpo.description if run.dpo else 'sft'} | {launch.description} | "
        f"global batch {batching.global_batch} = {batching.micro_batch} x {batching.accumulation} accumulation x "
        f"{batching.data_parallel_size} ranks | {run.max_steps} steps | precision {recipe.mixed_precision} "
        f"{reduction_dtypes(run.model)}".rstrip()
    )
    if warning := unfused_fp8_warning(recipe):
        accelerator.print(warning)


def refuse_non_finite(accelerator: Accelerator, step: int, summary: StepSummary, loss_scaled: bool) -> int:
    what = "loss" if loss_scaled else "loss or gradient norm"  # a loss scaler skips the steps of infinite norms
    if summary.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        what = f"gradient norm at {summary.skipped_in_a_row} steps in a row, whatever the loss scale, ending"
    accelerator.print(f"shardtune: error: non-finite {what} at step {step} "
                      f"(loss {summary.loss}, grad norm {summary.grad_norm}); nothing saved from this "
                      "state. Lower --learning_rate or resume from the last checkpoint.")
    return NON_FINITE_EXIT_CODE


def save_and_stop(accelerator: Accelerator, checkpointer: Checkpointer, step: int) -> int:
    """A stop signal reached a rank: every rank saves the checkpoint of this step, then the run exits with code 75."""
    checkpointer.save(step)
    checkpointer.wait()
    accelerator.print(f"shardtune: stop signal received; checkpoint at step {step} saved, "
                      f"exiting with code {PREEMPTED_EXIT_CODE} (resume with --resume_from_checkpoint auto)",
                      flush=True)  # a requeue script reads it while the launchers shut down
    return PREEMPTED_EXIT_CODE


def log_eval(accelerator: Accelerator, run: Run, output_dir: str, step: int) -> dict[str, float]:
    reset_phase_peak(accelerator.device)  # the eval's own peak, logged apart from the training windows'
    with phase("eval"):
        eval_metrics = evaluate_pairs(run.model, run.eval_loader, accelerator, run.dpo.step) if run.dpo else \
            evaluate(run.model, run.eval_loader, accelerator)
    accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
    log_metrics(accelerator, output_dir, step, eval_metrics)
    log_metrics(accelerator, output_dir, step, phase_peak_gb(accelerator.device, "eval"))
    if run.held_out is not None:  # under ZeRO-3 / FSDP one full parameter gather per token: the time is shown
        started = time.perf_counter()
        with eager_calls():
            samples = generate_samples(accelerator, run.model, run.tokenizer, run.held_out)
        accelerator.print(f"step {step}: {len(samples)} samples generated in {time.perf_counter() - started:.1f}s "
                          f"(samples.jsonl)")
        log_samples(accelerator, output_dir, step, samples)
    return eval_metrics


def finish(accelerator: Accelerator, recipe: Recipe, run: Run, checkpointer: Checkpointer,
           metrics: TrainMetrics) -> int:
    """After the last step: the checkpoint still being written, the Hugging Face export, the final eval."""
    checkpointer.wait()
    output_dir = recipe.resolved_output_dir
    if recipe.save_model:  # before the final eval: an eval that fails must not cost the trained model
        set_collective_timeout(recipe.startup_timeout_minutes)  # gathering the full weights is no step's wait
        reset_phase_peak(accelerator.device)
        with phase("save"):
            save_hf_model(accelerator, run.model, run.tokenizer, output_dir, run.save_dtype)
        log_metrics(accelerator, output_dir, run.max_steps, phase_peak_gb(accelerator.device, "save"))
        set_collective_timeout(recipe.collective_timeout_minutes)
    eval_metrics = log_eval(accelerator, run, output_dir, run.max_steps)
    if metrics.first_loss is not None:
        accelerator.print(f"first loss {metrics.first_loss:.4f} | last loss {metrics.last_loss:.4f} | "
                          + " | ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
    return 0

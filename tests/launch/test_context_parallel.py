"""Context parallelism (accelerate_configs/fsdp_cp.yaml) on 2 CPU ranks through torch's own ring attention: torch
has no CPU kernel for it, and tests/launch/context_parallel_probe.py maps CPU's attention op into the same ring
before running the tiny recipe (conftest.recipe_command launches it for the config); everything else is the GPU
path (accelerate's CP mesh and maybe_context_parallel, FSDP2 over dp_shard x cp, the trainer's shifted labels, loss
scale and counts, eval under the split). The config's reference run (conftest.reference_run: every sequence cut
over both ranks, one data rank of 8 x 4 as the one process) trains as one process in
tests/launch/test_strategies.py and its phases match the plan in tests/launch/test_memory_phases.py; here, each
token counted once in the logs and the eval, and its checkpoint resumed on 1 process under FSDP2 without the
split and on 4 under the split (cp 2 x dp_shard 2)."""

from __future__ import annotations

import runpy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardtune.generation import MAX_NEW_TOKENS
from tests.conftest import (
    CONTEXT_PARALLEL_PROBE,
    CP_SAMPLES,
    REFERENCE_ARGS,
    TINY_RECIPE,
    grad_norms,
    read_metrics,
    run_recipe,
    train_losses,
)
from tests.launch.test_outputs import read_samples
from tests.launch.test_strategies import FP32_RTOL
from tests.launch.test_tensor_parallel import final_eval


def test_context_parallel_counts_each_token_once(reference_run):
    """A rank that ran its rows whole, or a group whose rows were counted on every rank, would double the counts;
    the eval's loss and accuracy are the one process's."""
    split, single = reference_run("fsdp_cp"), reference_run(None)
    rows = {name: [row for row in read_metrics(run) if "loss" in row] for name, run in (("cp", split), ("one", single))}
    for key in ("tokens_per_step", "sequences_per_step"):
        assert [row[key] for row in rows["cp"]] == [row[key] for row in rows["one"]], key
    # the rows padded to a multiple of 2 x cp (two chunks per rank): more positions processed, the same tokens
    for ours, theirs in zip(rows["cp"], rows["one"], strict=True):
        assert ours["token_utilization"] < theirs["token_utilization"]
    assert final_eval(split) == pytest.approx(final_eval(single), rel=FP32_RTOL)


@pytest.mark.parametrize("context_parallel", [False, True], ids=["fsdp2-alone-1-process", "cp-kept-4-processes"])
def test_a_context_parallel_checkpoint_resumes_on_another_number_of_ranks(context_parallel, reference_run,
                                                                         tiny_assets, tmp_path):
    """torch.distributed.checkpoint reshards: checkpoint-4 of cp 2 (2 ranks) resumed on 1 process under FSDP2
    without the split (8 x 4), or on 4 under the same config at cp 2 x dp_shard 2 (as on two nodes: 8 x 2 x 2 data
    ranks), trains steps 5 to 8 as the split run did, to fp32 rounding."""
    reference = reference_run("fsdp_cp")
    output_dir = tmp_path / "out"
    launch = dict(config="fsdp_cp", processes=4, recipe=CONTEXT_PARALLEL_PROBE,
                  launch_args=("--parallelism_config_cp_size", "2", "--parallelism_config_dp_shard_size", "2")) \
        if context_parallel else dict(config="fsdp_full_shard", processes=1)
    result = run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--resume_from_checkpoint",
                        str(reference / "checkpoint-4"), **launch)
    assert (("each sequence split over 1 rank(s) (context parallel) where the checkpoint had 2: "
             "torch.distributed.checkpoint reshards" in result.stdout) != context_parallel), result.stdout[-3000:]
    changed = ("4 processes where the checkpoint had 2: micro-batch 8 x 2 accumulation x 2 data ranks"
               if context_parallel else "1 process where the checkpoint had 2: micro-batch 8 x 4 accumulation x 1 "
               "data ranks")
    assert f"{changed} where it had micro-batch 8 x 4 accumulation x 1 data ranks" in result.stdout, \
        result.stdout[-3000:]
    assert [row["step"] for row in read_metrics(output_dir) if "loss" in row] == [5, 6, 7, 8]
    assert train_losses(output_dir) == pytest.approx(train_losses(reference)[4:], rel=FP32_RTOL)
    assert grad_norms(output_dir) == pytest.approx(grad_norms(reference)[4:], rel=FP32_RTOL)


def test_samples_under_context_parallelism_are_the_trained_model_s_own(reference_run, tiny_assets):
    """The final eval's answers to held-out prompts, generated outside the ring attention by a model whose
    attention masks accelerate's CP hooks drop: greedy, one prompt at a time, they are what the saved model
    generates alone."""
    output_dir = reference_run("fsdp_cp")
    samples = [row for row in read_samples(output_dir) if row["step"] == 8]
    assert len(samples) == CP_SAMPLES
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    model = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32).eval()
    max_length = runpy.run_path(str(TINY_RECIPE))["RECIPE"].max_seq_length  # where generation stops at the latest
    for row in samples:
        ids = tokenizer(row["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=min(MAX_NEW_TOKENS, max_length - ids.shape[1]), do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == row["completion"], row

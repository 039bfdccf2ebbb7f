"""DPO in the planner (shardtune.plan.preference): a pair is two sequences in one forward, and the reference is held
as its mode holds it: nothing (adapter, precomputed), a copy sharded as the policy (FSDP2, ZeRO-3) or whole on every
GPU (DDP, ZeRO-1/2); its forward and the precompute pass are phases of their own; a whole reference that does not
fit is refused with what to change."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from shardtune.config import LOSS_TILE_POSITIONS, Recipe
from shardtune.models.flops import BUILTIN_CONFIG_VALUES, resolve_model
from shardtune.plan.__main__ import main
from shardtune.plan.activations import eval_activation_bytes
from shardtune.plan.buffers import resharded_after_forward
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.launched import plan_launch
from shardtune.plan.planned_run import plan_recipe
from shardtune.plan.planner import plan
from shardtune.plan.preference import profiled_phase_totals
from shardtune.plan.report import format_plan
from shardtune.plan.search import Search, candidates
from shardtune.plan.states import Peft, deepspeed_sizes, largest_parameter, persistent_elements
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config

H100 = parse_hardware("8xh100-80gb")
LLAMA8B = resolve_model("llama-3.1-8b")
P = LLAMA8B.params
SEQ = 1024


def config(name: str, precision: str = "bf16"):
    return read_accelerate_config(os.path.join(CONFIGS_DIR, f"{name}.yaml"), precision)


def dpo(name: str, reference: str | None, micro: int = 1, precision: str = "bf16", **options):
    return plan(LLAMA8B, H100, config(name, precision), micro, SEQ, chunked_cross_entropy=True,
                reference=reference, **options)


@pytest.mark.parametrize("name", ["ds_zero3", "fsdp_full_shard", "ds_zero2", "ddp"])
def test_a_pair_is_two_sequences(name):
    """Without a reference held, a DPO micro-batch of 1 pair plans as SFT's micro-batch of 2 sequences, and its
    eval of 4 pairs as SFT's of 8 sequences, the head computed in tiles of the flat positions."""
    pairs = dpo(name, "precomputed", micro=1, eval_batch=4)
    sequences = dpo(name, None, micro=2, eval_batch=8)
    assert pairs.phases["forward_backward"] == sequences.phases["forward_backward"]
    assert pairs.phases["forward_backward"]["activations"] > dpo(name, None, micro=1).phases["forward_backward"][
        "activations"]
    mode = "autocast" if name == "ddp" else "half"
    tiled = eval_activation_bytes(LLAMA8B, 8, SEQ, mode, head_positions=LOSS_TILE_POSITIONS)
    assert pairs.phases["eval"]["activations"] == tiled
    assert pairs.method == "dpo" and pairs.micro_batch == 1 and pairs.reference_mode == "precomputed"


def test_a_live_reference_under_zero3_is_its_partition():
    """ZeRO-3: 2 bytes a parameter over the 8 GPUs (bf16), with the engine's persistent small parameters whole;
    4 bytes in fp32. The same in every phase; its forward gathers as the policy's eval does."""
    for precision, low in (("bf16", 2), ("no", 4)):
        strategy = config("ds_zero3", precision)
        live = dpo("ds_zero3", "live", precision=precision)
        expected = low * P / 8 + low * persistent_elements(strategy, LLAMA8B)
        assert expected == pytest.approx(low * P / 8, rel=1e-3)
        for name in ("forward_backward", "optimizer", "eval", "save", "reference_forward"):
            assert live.phases[name]["reference"] == pytest.approx(expected), (precision, name)
        prefetch = deepspeed_sizes(strategy, LLAMA8B)["prefetch_bucket"]
        assert live.phases["reference_forward"]["gathered"] == 2 * (largest_parameter(LLAMA8B) + prefetch) * low
    assert dpo("ds_zero3", "live").reference_layout == "sharded as the policy"


def test_a_live_reference_under_fsdp2_keeps_what_its_forward_never_reshards():
    """FULL_SHARD: the shard, and the head's unit (reshard_after_forward False) that a reference, running no
    backward, keeps gathered; SHARD_GRAD_OP keeps every layer gathered: the shard and the whole model."""
    root = P - LLAMA8B.layers * LLAMA8B.layer_params
    full = dpo("fsdp_full_shard", "live").phases["forward_backward"]["reference"]
    assert full == pytest.approx(2 * P / 8 + 2 * (root - resharded_after_forward(LLAMA8B)))
    grad_op = dpo("fsdp_shard_grad_op", "live").phases["forward_backward"]["reference"]
    assert grad_op == pytest.approx(2 * P / 8 + 2 * P)


@pytest.mark.parametrize("name", ["ddp", "ds_zero1", "ds_zero2"])
def test_a_live_reference_is_whole_on_every_gpu_below_zero3(name):
    live, alone = dpo(name, "live"), dpo(name, "precomputed")
    assert live.phases["forward_backward"]["reference"] == 2 * P
    assert live.phases["forward_backward"]["total"] == pytest.approx(alone.phases["forward_backward"]["total"] + 2 * P)
    assert live.reference_layout == "whole on every GPU"
    assert live.phases["reference_forward"]["gathered"] == 0


@pytest.mark.parametrize("reference", ["adapter", "precomputed"])
def test_no_reference_model_is_held_without_a_live_one(reference):
    peft = Peft(16, "all-linear") if reference == "adapter" else None
    planned = dpo("ds_zero3", reference, peft=peft)
    assert all("reference" not in parts for parts in planned.phases.values())
    assert "reference_loading" not in planned.host_ram
    assert ("reference_forward" in planned.phases) == (reference == "adapter")
    assert ("reference_precompute" in planned.phases) == (reference == "precomputed")


def test_the_reference_forward_is_a_phase_before_the_policy_s():
    """Its parts: the states (no gradient at accumulation 1 on one process), the reference, gathered parameters and
    the activations of a no_grad forward over both sequences of each pair with the batch's tensors. A step's
    profiled peak is the larger of it and forward/backward."""
    live = dpo("ds_zero3", "live", micro=2)
    forward = live.phases["reference_forward"]
    assert forward["total"] == pytest.approx(sum(value for name, value in forward.items()
                                                 if name not in ("total", "on_host")))
    assert forward["activations"] > eval_activation_bytes(LLAMA8B, 4, SEQ, "half",
                                                          head_positions=LOSS_TILE_POSITIONS)
    totals = profiled_phase_totals(live.phases)
    assert "reference_forward" not in totals
    assert totals["forward_backward"] == max(live.phases["forward_backward"]["total"], forward["total"])
    assert live.per_gpu["total"] == max(parts["total"] for parts in live.phases.values())


def test_the_precompute_pass_is_a_phase_without_optimizer_states_torch_has_not_made():
    """The pass runs before the first step at the larger of the train and eval batches, two sequences a pair:
    torch's optimizers have no states yet, DeepSpeed's were made at start-up."""
    fsdp = dpo("fsdp_full_shard", "precomputed", micro=2, eval_batch=1).phases["reference_precompute"]
    assert fsdp["optimizer"] == 0
    assert fsdp["activations"] == eval_activation_bytes(LLAMA8B, 4, SEQ, "half", head_positions=LOSS_TILE_POSITIONS)
    zero3 = dpo("ds_zero3", "precomputed")
    assert zero3.phases["reference_precompute"]["optimizer"] == zero3.phases["optimizer"]["optimizer"] > 0


def test_a_live_reference_loads_after_the_policy_in_its_compute_dtype():
    """Host RAM: every process reads a bf16 copy under ZeRO-2, one per node under ZeRO-3's zero.Init."""
    assert dpo("ds_zero2", "live").host_ram["reference_loading"] == 2 * P * 8
    assert dpo("ds_zero3", "live").host_ram["reference_loading"] == 2 * P
    offloaded = dpo("ds_zero3_cpu_offload", "live")
    assert offloaded.host_ram["reference_offloaded"] == pytest.approx(2 * P)  # 8 ranks' partitions of 2P/8
    assert "reference" not in offloaded.phases["forward_backward"] or \
        offloaded.phases["forward_backward"]["reference"] < 1e7  # only its persistent small parameters


def test_a_whole_live_reference_that_does_not_fit_is_refused_with_what_to_change():
    """ZeRO-2 at 2 pairs a micro-batch: the policy fits, the reference's 16 GB does not; the launch's refusal says
    to shard it, precompute it or train LoRA, before the fastest plan that fits."""
    recipe = Recipe(model_name_or_path="meta-llama/Llama-3.1-8B-Instruct", method="dpo", max_seq_length=SEQ,
                    per_device_train_batch_size=2, global_batch_size=128, gradient_checkpointing=False)
    live = plan_recipe(LLAMA8B, H100, config("ds_zero2"), recipe)
    precomputed = plan_recipe(LLAMA8B, H100, config("ds_zero2"),
                              dataclasses.replace(recipe, precompute_ref_log_probs=True))
    assert not live.fits and precomputed.fits
    assert "--precompute_ref_log_probs true" in live.reference_advice and live.reference_advice in live.notes
    chosen, message = plan_launch(LLAMA8B, H100, recipe, config("ds_zero2"))
    assert message.startswith("The live reference is a whole 16.1 GB copy on every GPU under ds_zero2")
    assert "ds_zero3.yaml" in message and "--use_peft true" in message and "The fastest plan that fits" in message
    # sharded, it is no whole copy: nothing to advise even where it does not fit
    assert dpo("ds_zero3", "live", micro=64).reference_advice == ""


def test_the_plan_names_the_method_and_the_reference(capsys):
    text = format_plan(dpo("ds_zero2", "live"))
    assert "method dpo: each pair 2 sequences (2 per micro-batch), reference live (a frozen bf16 copy, whole on " \
           "every GPU)" in text
    assert "reference forward" in text and "the live reference loading 128.5 GB" in text
    code = main(["--model", "llama-3.1-8b", "--method", "dpo", "--max_seq_length", str(SEQ), "--config_file",
                 os.path.join(CONFIGS_DIR, "ds_zero3.yaml"), "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert code == 0 and planned["reference_mode"] == "live" and "reference_forward" in planned["phases"]


def test_the_planner_refuses_a_reference_flag_without_dpo(capsys):
    assert main(["--model", "llama-3.1-8b", "--precompute_ref_log_probs", "true"]) == 2
    assert "add --method dpo" in capsys.readouterr().err


def test_a_dpo_search_never_offers_the_sequence_split():
    """The trainer refuses DPO under the sequence split: the search for rows too long for one GPU skips it."""
    search = Search(global_batch=8, seq=131072, reference="precomputed")
    offered = {candidate.config for candidate, _, _ in candidates(LLAMA8B, H100, search)}
    assert "ds_zero3" in offered and not any("ulysses" in name for name in offered)
    assert any("ulysses" in candidate.config for candidate, _, _ in
               candidates(LLAMA8B, H100, dataclasses.replace(search, reference=None)))


LLAMA1B = resolve_model("llama-3.2-1b")


@pytest.mark.parametrize("name", ["ddp", "ds_zero2"])
def test_a_reference_of_another_size_is_planned_at_its_own_whole(name):
    """A whole live reference (DDP, ZeRO-1/2) of Llama-3.2-1B beside an 8B policy: 2 bytes a parameter of its own
    1.24B, in every phase and in the host RAM it loads through; the policy's states are as they were. The plan
    names the model and its size."""
    same, small = dpo(name, "live"), dpo(name, "live", reference_shape=LLAMA1B)
    difference = 2 * (P - LLAMA1B.params)
    for phase in ("forward_backward", "optimizer", "eval", "save"):
        assert same.phases[phase]["reference"] - small.phases[phase]["reference"] == difference, phase
        assert small.phases[phase]["reference"] == 2 * LLAMA1B.params
        assert same.phases[phase]["total"] - small.phases[phase]["total"] == pytest.approx(difference), phase
    assert same.host_ram["reference_loading"] - small.host_ram["reference_loading"] == difference * 8
    assert (small.reference_model, small.reference_params) == ("llama-3.2-1b", LLAMA1B.params)
    assert "reference live (a frozen bf16 copy of llama-3.2-1b (1.24B params), whole on every GPU)" in \
        format_plan(small)


def test_a_reference_of_another_size_is_planned_at_its_own_partition():
    """Under ZeRO-3 the reference's partition is its own 2P/8 (with its own persistent small parameters), and its
    forward gathers its own largest parameter and prefetch bucket."""
    strategy = config("ds_zero3")
    small = dpo("ds_zero3", "live", reference_shape=LLAMA1B)
    own = 2 * LLAMA1B.params / 8 + 2 * persistent_elements(strategy, LLAMA1B)
    assert small.phases["forward_backward"]["reference"] == pytest.approx(own)
    prefetch = deepspeed_sizes(strategy, LLAMA1B)["prefetch_bucket"]
    assert small.phases["reference_forward"]["gathered"] == 2 * (largest_parameter(LLAMA1B) + prefetch) * 2


def test_a_named_reference_is_held_for_the_precompute_pass_alone():
    """--precompute_ref_log_probs with --ref_model_name_or_path loads that model for the pass: its partition in
    that phase only, and the pass's activations its own forward's (Llama-3.2-1B's 2048-wide residual stream)."""
    small = dpo("ds_zero3", "precomputed", reference_shape=LLAMA1B)
    policy = dpo("ds_zero3", "precomputed")
    assert small.phases["reference_precompute"]["reference"] == pytest.approx(
        2 * LLAMA1B.params / 8 + 2 * persistent_elements(config("ds_zero3"), LLAMA1B))
    assert all("reference" not in parts for name, parts in small.phases.items() if name != "reference_precompute")
    assert small.phases["forward_backward"] == policy.phases["forward_backward"]
    assert small.phases["reference_precompute"]["activations"] < policy.phases["reference_precompute"]["activations"]


def test_the_planner_reads_the_reference_s_config(tmp_path, capsys):
    """--ref_model_name_or_path of a local model directory is planned from its config.json, as --model is: a
    reference of half the layers holds what its own parameter count makes, not the policy's."""
    policy = json.loads(json.dumps(BUILTIN_CONFIG_VALUES["llama-3.2-1b"]))
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "config.json").write_text(json.dumps({**policy, "num_hidden_layers": 8,
                                                              "architectures": ["LlamaForCausalLM"]}))
    half = dataclasses.replace(LLAMA1B, layers=8)
    plans = {}
    for reference in ("", str(tmp_path / "ref")):
        flags = ["--ref_model_name_or_path", reference] if reference else []
        assert main(["--model", "llama-3.2-1b", "--method", "dpo", "--config_file",
                     os.path.join(CONFIGS_DIR, "ddp.yaml"), "--json", *flags]) == 0
        plans[reference] = json.loads(capsys.readouterr().out)
    named = plans[str(tmp_path / "ref")]
    assert named["reference_params"] == half.params and named["reference_model"] == "ref"
    assert plans[""]["phases"]["forward_backward"]["reference"] - named["phases"]["forward_backward"]["reference"] \
        == 2 * 8 * LLAMA1B.layer_params

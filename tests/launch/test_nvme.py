"""ZeRO-3 with parameters and optimizer on NVMe, at sizes where DeepSpeed really swaps: a Llama of 1024-wide
matrices (1,048,576 elements, above the shipped persistence threshold; 2 MiB fp32 partitions per rank, above the
swappers' 1 MiB smallest I/O), recomputation on, 2 ranks. The shipped JSON runs with its own buffer_count and
stage3_max_reuse_distance; only the sizes that scale with the model are set here: optimizer sub-groups of about
two matrices (several swapped, the norms' sub-group too small to swap), parameter buffers of one matrix
partition, no partition kept in host RAM (max_in_cpu 0). A kill -9 at step 3 and a resume give the uninterrupted
run's losses, Adam states (swap files and the unswapped sub-group) and weights bit for bit, and export_hf.py on
an NVMe checkpoint (in this process) writes the run's own final weights."""

from __future__ import annotations

import filecmp
import json

import pytest
import torch
from safetensors.torch import load_file

from shardtune.checkpoint.preemption import FAULT_ENV
from shardtune.models.tiny_assets import write_tiny_assets
from tests.conftest import (
    CONFIGS,
    grad_norms,
    kill_tree,
    nvme_args,
    read_metrics,
    start_recipe,
    train_losses,
    wait_all,
    wait_for_ranks,
)
from tests.launch.test_checkpoint import export, wait_for_text

CONFIG = "ds_zero3_nvme_offload"
WIDE_LLAMA = {"hidden_size": 1024, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 4}
SIZES = {"reduce_bucket_size": 1_000_000, "stage3_prefetch_bucket_size": 2_000_000, "sub_group_size": 1_100_000}
PARAM_SWAP = {"buffer_size": 600_000, "max_in_cpu": 0}
STEPS = 4
FAULT_STEP = 3  # the newest checkpoint before it is checkpoint-2
ARGS = ("--max_steps", str(STEPS), "--save_steps", "2", "--save_total_limit", "0", "--mixed_precision", "no",
        "--per_device_train_batch_size", "4", "--global_batch_size", "8", "--weight_decay", "0.1",
        "--warmup_ratio", "0", "--gradient_checkpointing", "true")


@pytest.fixture(scope="module")
def wide_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme")
    write_tiny_assets(str(root / "assets"), num_examples=256, **WIDE_LLAMA)
    launch = json.loads((CONFIGS / "deepspeed" / "zero3_nvme_offload.json").read_text())
    launch["zero_optimization"].update(SIZES)
    launch["zero_optimization"]["offload_param"].update(PARAM_SWAP)
    (root / "ds.json").write_text(json.dumps(launch))
    return root, (str(root / "assets" / "model"), str(root / "assets" / "data.jsonl"))


def run(root, assets, name: str, fault: str | None = None, resume: bool = False):
    """Start the run `name` into root/name/out (swap files in root/name/nvme, log root/name/<log_name>.log)."""
    (root / name).mkdir(exist_ok=True)
    return start_recipe(root / name / "out", assets, *ARGS, *nvme_args(CONFIG, root / name),
                        *(("--resume_from_checkpoint", "auto") if resume else ()), config=CONFIG, processes=2,
                        launch_args=("--deepspeed_config_file", str(root / "ds.json")),
                        env={FAULT_ENV: fault} if fault else None, log_name="resumed" if resume else "run")


def optimizer_states(checkpoint) -> list[dict]:
    return [torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
            for path in sorted((checkpoint / "pytorch_model").glob("*_optim_states.pt"))]


def test_kill_resume_and_export_under_nvme_offload(wide_setup, tmp_path):
    root, assets = wide_setup
    whole = run(root, assets, "whole")
    wait_all([whole], timeout=900)
    assert whole.returncode == 0, (root / "whole" / "run.log").read_text()[-4000:]

    killed = run(root, assets, "killed", fault=f"rank=1,step={FAULT_STEP},micro_batch=0,signal=SIGKILL")
    ranks = wait_for_ranks(killed, 2)
    wait_for_text(root / "killed" / "run.log", f"rank 1 sends itself SIGKILL at step {FAULT_STEP}", [killed])
    kill_tree(killed, ranks)
    resumed = run(root, assets, "killed", resume=True)
    wait_all([resumed], timeout=900)
    log = (root / "killed" / "resumed.log").read_text()
    assert resumed.returncode == 0, log[-4000:]
    assert f"resumed from {root}/killed/out/checkpoint-{FAULT_STEP - 1} at step {FAULT_STEP - 1}" in log, log[-4000:]

    ours, theirs = root / "killed" / "out", root / "whole" / "out"
    assert [row["step"] for row in read_metrics(ours) if "loss" in row] == list(range(1, STEPS + 1))
    assert train_losses(ours) == train_losses(theirs)  # bitwise
    assert grad_norms(ours) == grad_norms(theirs)

    # DeepSpeed chunked and swapped as a large model's run does: several optimizer sub-groups per rank on NVMe
    # (empty in optim_states.pt), the norms' sub-group in it, and the parameters swapped too.
    final = f"checkpoint-{STEPS}"
    for rank, (mine, reference) in enumerate(zip(optimizer_states(ours / final), optimizer_states(theirs / final),
                                                 strict=True)):
        sizes = [group.numel() for group in reference["fp32_flat_groups"]]
        assert sizes.count(0) >= 2 and any(sizes), sizes
        for index, state in reference["optimizer_state_dict"]["state"].items():
            assert mine["optimizer_state_dict"]["state"][index]["step"] == state["step"] == STEPS
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(mine["optimizer_state_dict"]["state"][index][name], state[name]), (rank, name)
        for a, b in zip(mine["fp32_flat_groups"], reference["fp32_flat_groups"], strict=True):
            assert torch.equal(a, b)
        swapped = theirs / final / "pytorch_model" / "offloaded_tensors" / f"rank{rank:02d}"
        names = sorted(path.name for path in swapped.iterdir())
        assert any(name.startswith("exp_avg_sq-") for name in names)
        match, mismatch, errors = filecmp.cmpfiles(swapped, str(swapped).replace(str(theirs), str(ours)), names,
                                                   shallow=False)
        assert not mismatch and not errors, (mismatch, errors)  # master weights and Adam moments, bitwise
    assert any((root / "whole" / "nvme" / "zero_stage_3" / "float32params").rglob("*.swp"))
    final_weights = load_file(theirs / "model.safetensors")
    resumed_weights = load_file(ours / "model.safetensors")
    for key, tensor in final_weights.items():
        assert torch.equal(resumed_weights[key], tensor), key

    # The NVMe checkpoint exports to the run's own final weights.
    export(ours / final, tmp_path / "out")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == final_weights.keys()
    for key, tensor in final_weights.items():
        assert torch.equal(exported[key], tensor), key

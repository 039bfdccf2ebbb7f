"""The multi-machine layouts as the planner and the launch read them: FSDP2's hybrid sharding
(fsdp_hybrid_shard.yaml, accelerate's parallelism_config) and ZeRO++'s hierarchical partitioning
(ds_zero3_hpz.yaml, zero_hpz_partition_size), planned per GPU against figures derived by hand. Their launches on
2 loopback machines are in tests/launch/test_multinode_layouts.py."""

from __future__ import annotations

import json
import os

import pytest

from shardtune.config import ConfigError
from shardtune.launch import LaunchDescription
from shardtune.models.flops import resolve_model
from shardtune.plan.__main__ import main as plan_main
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.planner import plan
from shardtune.plan.strategy import read_accelerate_config
from tests.conftest import CONFIGS

HYBRID, HPZ, FULL_SHARD, ZERO3 = (str(CONFIGS / f"{name}.yaml") for name in
                                  ("fsdp_hybrid_shard", "ds_zero3_hpz", "fsdp_full_shard", "ds_zero3"))
# Llama-3.1-8B: every parameter's size is a multiple of 16 (hidden 4096, KV 1024, MLP 14336, vocabulary 128256),
# so ZeRO's partitions need no padding on 8 or 16 GPUs and every figure below is an exact fraction of P.
SHAPE = resolve_model("llama-3.1-8b")
P = SHAPE.params
ONE_NODE, TWO_NODES = parse_hardware("8xh100-80gb"), parse_hardware("2x8xh100-80gb")


def planned(config: str, hardware=TWO_NODES):
    return plan(SHAPE, hardware, read_accelerate_config(config, "bf16"), micro_batch=1, seq=4096)


def test_the_configs_name_their_layouts():
    hybrid, hpz = read_accelerate_config(HYBRID), read_accelerate_config(HPZ)
    assert (hybrid.kind, hybrid.shard, hybrid.shard_group) == ("fsdp", 3, 8)
    assert (hpz.kind, hpz.shard, hpz.hpz_partition) == ("deepspeed", 3, 8)
    assert (read_accelerate_config(FULL_SHARD).shard_group, read_accelerate_config(ZERO3).hpz_partition) == (0, 1)


def test_hybrid_sharding_holds_one_nodes_share_of_the_states():
    """On 2 nodes of 8, FSDP2 keeps fp32 weights, fp32 gradients and Adam's m and v (4 + 4 + 8 bytes per parameter)
    sharded over the 8 GPUs of its node: 4P/8, 4P/8, 8P/8 per GPU, twice FULL_SHARD's over all 16. Every phase
    and the host RAM per node are those of one node alone, as the replica is."""
    hybrid, full = planned(HYBRID), planned(FULL_SHARD)
    assert (hybrid.per_gpu["weights"], hybrid.per_gpu["gradients"], hybrid.per_gpu["optimizer"]) == (
        4 * P / 8, 4 * P / 8, 8 * P / 8)
    assert full.per_gpu["weights"] == 4 * P / 16
    alone = planned(FULL_SHARD, ONE_NODE)
    assert hybrid.phases == alone.phases and hybrid.host_ram == alone.host_ram
    assert (hybrid.world_size, hybrid.layout, full.layout) == (
        16, "sharded over 8 GPUs, replicated x2", "sharded over 16 GPUs")
    # On one node the hybrid layout is FULL_SHARD.
    assert planned(HYBRID, ONE_NODE).phases == alone.phases


def test_hpz_adds_a_node_sharded_copy_of_the_16_bit_weights():
    """ZeRO-3 on 16 GPUs in bf16 holds 2P/16 of 16-bit weights; hpZ adds its secondary copy sharded over the 8
    GPUs of a node, 2P/8, in every phase; gradients and optimizer states are ZeRO-3's."""
    hpz, zero3 = planned(HPZ), planned(ZERO3)
    assert zero3.per_gpu["weights"] == 2 * P / 16
    assert hpz.per_gpu["weights"] == 2 * P / 16 + 2 * P / 8
    for phase in ("forward_backward", "optimizer", "eval", "save"):
        assert hpz.phases[phase]["total"] - zero3.phases[phase]["total"] == pytest.approx(2 * P / 8, rel=1e-12)
    assert (hpz.per_gpu["gradients"], hpz.per_gpu["optimizer"]) == (zero3.per_gpu["gradients"],
                                                                     zero3.per_gpu["optimizer"])
    assert hpz.layout == "sharded over 16 GPUs, a copy of the weights sharded over 8"


def test_plan_cli_takes_num_machines_and_prints_the_layout(capsys):
    code = plan_main(["--model", "llama-3.1-8b", "--hardware", "8xh100-80gb", "--num_machines", "2",
                      "--config_file", HYBRID, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (result["world_size"], result["layout"]) == (16, "sharded over 8 GPUs, replicated x2")
    assert result["per_gpu"]["weights"] == 4 * P / 8
    assert plan_main(["--model", "llama-3.1-8b", "--hardware", "8xh100-80gb", "--num_machines", "2",
                      "--config_file", HYBRID]) == 0
    assert "  states sharded over 8 GPUs, replicated x2" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(("argv", "message"), [
    (["--hardware", "2x8xh100-80gb", "--num_machines", "4"], "--hardware 2x8xh100-80gb names 2 nodes and "
                                                              "--num_machines 4 differs"),
    (["--num_machines", "0"], "--num_machines must be >= 1, got 0."),
])
def test_plan_cli_refuses_a_node_count_it_cannot_use(argv, message, capsys):
    assert plan_main(["--model", "llama-3.1-8b", "--config_file", HYBRID, *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("shardtune.plan: error: ") and message in line


def launch_env(monkeypatch, **parallelism: str) -> None:
    """What `accelerate launch` exports for fsdp_hybrid_shard.yaml on 2 x 8, with `parallelism` overriding sizes."""
    for name in [*os.environ]:
        if name.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            monkeypatch.delenv(name)
    env = {"WORLD_SIZE": "16", "RANK": "0", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
           "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8", "PARALLELISM_CONFIG_TP_SIZE": "1",
           "PARALLELISM_CONFIG_CP_SIZE": "1", "PARALLELISM_CONFIG_SP_SIZE": "1"}
    env.update({f"PARALLELISM_CONFIG_{name.upper()}": value for name, value in parallelism.items()})
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_a_hybrid_launch_is_planned_and_described_as_launched(monkeypatch):
    launch_env(monkeypatch)
    launch = LaunchDescription.from_env()
    assert launch.description == "FSDP2 FULL_SHARD over 8 ranks, replicated x2"
    assert launch.strategy("bf16").shard_group == 8


@pytest.mark.parametrize(("sizes", "message"), [
    ({"dp_shard_size": "4"}, "parallelism_config_dp_replicate_size 2 x parallelism_config_dp_shard_size 4 is not "
                             "the 16 processes launched"),
    ({"tp_size": "2", "dp_shard_size": "4"}, "dp_replicate_size 2 beside tp_size 2: hybrid sharding with tensor "
                                              "parallelism is not wired"),
    # Ulysses is DeepSpeed's and TP FSDP2's: a config giving both would otherwise run one of them silently
    ({"tp_size": "2", "sp_size": "2"}, "sets sp_size 2 and tp_size 2: the sequence split runs through DeepSpeed's "
                                       "Ulysses and tensor parallelism under FSDP2, so the two do not compose"),
])
def test_a_parallelism_config_the_trainer_cannot_run_is_refused(sizes, message, monkeypatch):
    launch_env(monkeypatch, **sizes)
    with pytest.raises(ConfigError) as error:
        LaunchDescription.from_env()
    (line,) = error.value.messages
    assert message in line and "\n" not in line


def test_compare_shows_the_multi_node_layouts_on_several_nodes_only(capsys):
    """On one node they are fsdp_full_shard and ds_zero3 with a second copy of the weights: left out there."""
    layouts = {"fsdp_hybrid_shard", "ds_zero3_hpz"}
    for hardware, shown in (("8xh100-80gb", set()), ("2x8xh100-80gb", layouts)):
        assert plan_main(["--model", "llama-3.1-8b", "--hardware", hardware, "--compare", "--json"]) == 0
        configs = {row["config"] for row in json.loads(capsys.readouterr().out)}
        assert configs & layouts == shown and "fsdp_full_shard" in configs


def test_an_hpz_group_that_does_not_divide_the_ranks_is_refused():
    from shardtune.launch import check_hpz

    check_hpz(8, 16)
    check_hpz(8, 4)  # DeepSpeed takes min(size, world): the 4 ranks are one group
    with pytest.raises(ConfigError, match="zero_hpz_partition_size 8 does not divide the 12 processes"):
        check_hpz(8, 12)


def test_stochastic_rounding_is_refused_and_not_planned_under_hybrid_sharding():
    """Each node's replica of a shard would round with draws of its own: the trainer refuses it in one line, and
    the search steps its rounding rungs under FULL_SHARD across the nodes instead."""
    from shardtune.checks.values import check_optimizer
    from shardtune.config import Recipe
    from shardtune.plan.search import Search, runs_under

    recipe = Recipe(optim="adamw_torch_8bit", bf16_stochastic_round=True, mixed_precision="bf16")
    check_optimizer(recipe, True, "fsdp", 16, loads=False)
    with pytest.raises(ConfigError) as error:
        check_optimizer(recipe, True, "fsdp", 16, loads=False, replicated=True)
    (message,) = error.value.messages
    assert "hybrid sharding" in message and "fsdp_full_shard.yaml" in message
    search = Search(mixed_precision="bf16")
    hybrid, full = read_accelerate_config(HYBRID, "bf16"), read_accelerate_config(FULL_SHARD, "bf16")
    assert not runs_under(hybrid, TWO_NODES, search, "adamw_torch_8bit", True)
    assert runs_under(hybrid, TWO_NODES, search, "adamw_torch_8bit", False)
    assert runs_under(full, TWO_NODES, search, "adamw_torch_8bit", True)

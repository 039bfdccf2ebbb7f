"""The embedding under tp 2 x dp_shard 2, as placed against the plan: transformers (5.24,
distributed/mixin.py init_parallel_plans) adds `embed_tokens: embedding_rowwise` to the model's plan whenever the
config's base_model_tp_plan is not empty (Llama's names no embedding), so shardtune.parallel.tensor's split shards
embed_tokens.weight over the vocabulary on the tp axis and replicate_unplanned leaves it alone; FSDP2 then shards each
tp slice over dp_shard. Four gloo ranks (torch.distributed.run) split the tiny model with apply_tensor_parallel and
shard it with FSDP2 over the dp_shard axis, as the trainer does under fsdp_tp.yaml; each writes the placements and
local shape of embed_tokens.weight, and the plan (shardtune.plan.tensor.sliced_shape: vocab / tp) is held to them."""

from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoConfig

from shardtune.models.flops import shape_from_config
from shardtune.plan.tensor import sliced_shape
from tests.conftest import ENV, REPO, free_port

PLACED = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from shardtune.parallel.tensor import apply_tensor_parallel

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
apply_tensor_parallel(model, mesh["tp"])
split = model.model.embed_tokens.weight
def described(placements):
    return [[type(p).__name__, getattr(p, "dim", None)] for p in placements]

placed = {"after_tp": described(split.placements), "tp_mesh": list(split.device_mesh.mesh_dim_names)}
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh["dp_shard"])
fully_shard(model, mesh=mesh["dp_shard"])
weight = model.model.embed_tokens.weight
placed.update(placements=described(weight.placements), mesh=list(weight.device_mesh.mesh_dim_names),
              shape=list(weight.shape), local=list(weight.to_local().shape))
with open(os.path.join(sys.argv[2], f"{dist.get_rank()}.json"), "w") as file:
    json.dump(placed, file)
dist.destroy_process_group()
"""


def test_the_embedding_is_sharded_over_the_vocabulary_as_planned(tiny_assets, tmp_path):
    model_dir = tiny_assets[0]
    script = tmp_path / "placed.py"
    script.write_text(PLACED)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                             "--master_port", str(free_port()), str(script), model_dir, str(tmp_path)],
                            env={**ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(4)]
    config = AutoConfig.from_pretrained(model_dir)
    shape = shape_from_config(config, "tiny")
    planned_rows = sliced_shape(shape, 2).vocab  # the plan's embedding rows per GPU of a tp group
    for placed in ranks:
        assert placed["after_tp"] == [["Shard", 0]] and placed["tp_mesh"] == ["tp"]  # split, not replicated
        assert placed["mesh"] == ["dp_shard", "tp"] and placed["shape"] == [shape.vocab, shape.hidden]
        # dp_shard: FSDP2's rows of each tp slice (strided: a shard of a shard); tp: the vocabulary
        assert placed["placements"] == [["_StridedShard", 0], ["Shard", 0]], placed
        # what each GPU holds: the tp slice's rows the plan counts, over the dp_shard ranks
        assert placed["local"] == [planned_rows // 2, shape.hidden]
    assert sum(placed["local"][0] for placed in ranks) == 2 * planned_rows == shape.vocab

"""FSDP's RAM-efficient loading: only global rank 0 reads the weights; the other ranks build the model on the
meta device and receive their shards from rank 0. Eight ranks share one host's RAM, so a full copy on every rank
is 8 copies per node (2.3 TB for Llama-3.1-70B in fp32). A 25M-parameter model (100 MB in fp32) makes the copy
visible in each rank's peak resident set size, which the tiny model's 0.4 MB would not. It is stored in bf16, as
Llama checkpoints are, so a rank that loads it for full fine-tuning converts it into an fp32 copy of its own."""

from __future__ import annotations

import pytest
import torch

from shardtune.models.flops import resolve_model
from shardtune.models.tiny_assets import write_tiny_assets
from shardtune.plan.host import checkpoint_page_cache_bytes, loading_host_bytes
from tests.conftest import read_metrics, run_recipe, strategy_as_launched

MEDIUM = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4)
ARGS = ("--max_steps", "1", "--per_device_train_batch_size", "1", "--global_batch_size", "2", "--max_seq_length",
        "32", "--save_steps", "0", "--save_model", "false", "--mixed_precision", "no")


@pytest.fixture(scope="module")
def medium_assets(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("medium") / "assets"
    write_tiny_assets(str(root), num_examples=64, save_dtype=torch.bfloat16, **MEDIUM)  # as the Hub's Llamas
    return str(root / "model"), str(root / "data.jsonl")


def loaded(output_dir, rank: int) -> tuple[int, int]:
    (row,) = [row for row in read_metrics(output_dir) if "held_weights_bytes" in row]
    return row[f"loaded_parameter_bytes_rank{rank}"], row[f"loaded_peak_rss_bytes_rank{rank}"]


def loading_rss(output_dir, rank: int) -> int:
    (row,) = [row for row in read_metrics(output_dir) if "held_weights_bytes" in row]
    return row[f"loaded_loading_rss_bytes_rank{rank}"]


def test_fsdp_reads_the_weights_on_rank_0_only(medium_assets, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(medium_assets[0]))
    model_bytes = 4 * sum(param.numel() for param in model.parameters())
    assert model_bytes > 90e6
    runs = {}
    for config in ("fsdp_full_shard", "ddp"):
        output_dir = tmp_path / config
        run_recipe(output_dir, medium_assets, *ARGS, config=config, processes=2)
        runs[config] = [loaded(output_dir, rank) for rank in (0, 1)]
    (fsdp_bytes_0, fsdp_rss_0), (fsdp_bytes_1, fsdp_rss_1) = runs["fsdp_full_shard"]
    (ddp_bytes_0, _), (ddp_bytes_1, ddp_rss_1) = runs["ddp"]
    print({config: [(bytes_ / 1e6, rss / 1e6) for bytes_, rss in ranks] for config, ranks in runs.items()})
    assert fsdp_bytes_0 == ddp_bytes_0 == ddp_bytes_1 == model_bytes  # rank 0 reads the full model
    assert fsdp_bytes_1 == 0  # the others hold nothing until their shards arrive
    # While loading and sharding, rank 1 peaks below a DDP rank by the fp32 copy it never makes, less the
    # broadcast's per-tensor buffers the allocator keeps (measured: 0.6 x the model below every rank that loads).
    assert fsdp_rss_1 < ddp_rss_1 - 0.4 * model_bytes
    assert fsdp_rss_1 < fsdp_rss_0 - 0.4 * model_bytes
    # Host RAM of the loading itself (from_pretrained's rise of the resident set) against the planner, summed over
    # the node's ranks: each copy of the fp32 model it plans (model_loading), and the mapped checkpoint's pages in
    # the resident set of every rank that reads them (checkpoint_page_cache, one page cache per node).
    params = resolve_model(medium_assets[0]).params
    for config, readers in (("ddp", 2), ("fsdp_full_shard", 1)):
        measured = sum(loading_rss(tmp_path / config, rank) for rank in (0, 1))
        planned = loading_host_bytes(strategy_as_launched(config), params, gpus_per_node=2)
        planned += readers * checkpoint_page_cache_bytes(params)
        print(f"{config}: loading rose the resident sets by {measured / 1e6:.1f} MB, planned {planned / 1e6:.1f} MB")
        assert measured == pytest.approx(planned, rel=0.1), config


def test_tied_embeddings_stay_tied_through_rank0_loading(tmp_path):
    """Llama-3.2-1B and 3B tie lm_head to embed_tokens (the tiny model does not). Under RAM-efficient loading the
    ranks shard a meta-device model and receive rank 0's weights: were the tie lost there, lm_head would train as a
    matrix of its own and the loss would leave DDP's after the first update. FSDP's losses, gradient norms and
    exported weights equal DDP's, and the export holds the one shared matrix."""
    from safetensors.torch import load_file

    from tests.conftest import grad_norms, train_losses
    from tests.launch.test_batch_split import WEIGHT_ATOL, WEIGHT_RTOL

    root = tmp_path / "tied"
    write_tiny_assets(str(root), num_examples=256, tie_word_embeddings=True)
    assets = (str(root / "model"), str(root / "data.jsonl"))
    runs = {}
    for config in ("ddp", "fsdp_full_shard"):
        runs[config] = tmp_path / config
        run_recipe(runs[config], assets, "--max_steps", "4", "--per_device_train_batch_size", "4",
                   "--global_batch_size", "16", "--save_steps", "0", "--mixed_precision", "no", "--eval_steps", "0",
                   config=config, processes=2)
    fsdp, ddp = runs["fsdp_full_shard"], runs["ddp"]
    assert train_losses(fsdp) == pytest.approx(train_losses(ddp), rel=1e-5)
    assert grad_norms(fsdp) == pytest.approx(grad_norms(ddp), rel=1e-5)
    weights, reference = load_file(fsdp / "model.safetensors"), load_file(ddp / "model.safetensors")
    assert "model.embed_tokens.weight" in reference and "lm_head.weight" not in reference  # tied: written once
    assert weights.keys() == reference.keys()
    for key, tensor in reference.items():
        torch.testing.assert_close(weights[key], tensor, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=key)

"""FSDP2 in this process, on one rank over gloo, prepared as the trainer prepares it (shardtune.parallel.distributed's
plugin, accelerate's FSDP2 preparation): what the step's loss is made of under bf16 mixed precision. The
launched runs (tests/launch/test_strategies.py) compare whole loss curves; here one loss is compared exactly."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import fsdp2_prepare_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.loss.loss_utils import ForCausalLMLoss

from shardtune.config import BatchSizes, Recipe
from shardtune.data.batches import COUNTS, make_collator
from shardtune.levers.optimizers import make_optimizer
from shardtune.parallel.distributed import enable_fsdp_on_cpu, fsdp_plugin
from shardtune.step import token_loss, train_step
from tests.unit.test_step import features

# What `accelerate launch` exports for accelerate_configs/fsdp_full_shard.yaml, on one rank.
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
            "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def fsdp_bf16(monkeypatch) -> Iterator[Accelerator]:
    """An Accelerator on FSDP2 with bf16 mixed precision, one rank, as parallel.distributed makes it on CPU."""
    for name, value in {**FSDP_ENV, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    plugin = fsdp_plugin("bf16", on_cpu=True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=plugin, step_scheduler_with_optimizer=False)
    enable_fsdp_on_cpu(accelerator, plugin)
    try:
        yield accelerator
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("chunked_cross_entropy", [False, True])
def test_fsdp_bf16_loss_is_the_fp32_loss_of_the_bf16_logits(fsdp_bf16, tiny_assets, chunked_cross_entropy):
    """FSDP2's output cast (MixedPrecisionPolicy.output_dtype bf16) applies to every floating output of the root
    module: the step's loss must not pass through it. The step's loss equals the fp32 cross-entropy of the bf16
    logits the same parameters give (before the update), to fp32 rounding, not to bf16's 0.4%."""
    accelerator = fsdp_bf16
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32)
    model.config.use_cache = False
    model = fsdp2_prepare_model(accelerator, model)
    recipe = Recipe(learning_rate=1e-3, mixed_precision="bf16")
    optimizer, scheduler = make_optimizer(model, recipe, max_steps=1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    batch = make_collator(tokenizer)(features(tokenizer))
    targets = torch.tensor(batch.pop(COUNTS)["targets"])

    unwrapped = accelerator.unwrap_model(model)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert logits.dtype == torch.bfloat16  # eval's logits stay in the compute dtype (shardtune.evaluation)
        expected = ForCausalLMLoss(logits.float(), batch["labels"], unwrapped.config.vocab_size,
                                   num_items_in_batch=targets)
        loss = token_loss(model, unwrapped, batch, targets)
    assert loss.dtype == torch.float32
    out = train_step(accelerator, model, optimizer, scheduler, [dict(batch)], targets,
                     BatchSizes(micro_batch=3, accumulation=1, world_size=1), max_grad_norm=1.0,
                     chunked_cross_entropy=chunked_cross_entropy)
    assert out.loss.dtype == torch.float32
    # bf16 keeps 8 significant bits: a rounded loss sits up to 2**-9 (2e-3) away; fp32 sums differ by ~1e-7.
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert out.loss.item() != pytest.approx(expected.to(torch.bfloat16).item(), rel=1e-6)


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_fsdp_saves_take_the_shards_where_they_live(monkeypatch, state_dict_type):
    """The plugin accelerate builds from the launch environment asks for offload_to_cpu; a sharded save must not
    pass it on (each save would copy every shard to new pageable host memory before the stager's own copy, and
    miss the stager's buffer cache). The loading side and a full state dict keep accelerate's options."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import _prepare_sd_options

    from shardtune.checkpoint.staging import fsdp_save_options

    for name, value in {**FSDP_ENV, "FSDP_STATE_DICT_TYPE": state_dict_type}.items():
        monkeypatch.setenv(name, value)
    plugin = FullyShardedDataParallelPlugin()
    loading = _prepare_sd_options(plugin)
    assert loading.cpu_offload  # accelerate's, what load_state reads with
    saving = fsdp_save_options(plugin)
    full = state_dict_type == "FULL_STATE_DICT"
    assert saving.full_state_dict is full
    assert saving.cpu_offload is full
    assert saving.broadcast_from_rank0 == loading.broadcast_from_rank0

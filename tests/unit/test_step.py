"""The training step and eval on a device that is not the host's.

On CPU every tensor lives in one place, so a loop that stacks a device tensor with a host tensor, or reads a
value back in the middle of a step, passes every CPU run and crashes (or stalls) on CUDA. The `meta` device
shows both here: mixing a host tensor into `stack` raises, and reading a value back (`.item()`, `.tolist()`)
raises, just as they would cost a crash or a sync on a GPU."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler

from shardtune.checks.values import check_attention
from shardtune.config import BatchSizes, ConfigError, Recipe
from shardtune.data.batches import COUNT_KEYS, COUNTS, StepBatch, counted_steps, make_collator, take_counts
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.evaluation import head_statistics, row_statistics
from shardtune.levers.optimizers import make_optimizer
from shardtune.levers.tiled_loss import shifted_labels
from shardtune.metrics import step_vector
from shardtune.step import StepOutput, norm_on_device, train_step

META = torch.device("meta")


def features(tokenizer, rows=(("rev abc=", "cba"), ("rev abcdefgh=", "hgfedcba"), ("rev ab=", "ba"))):
    out = []
    for prompt, completion in rows:
        prompt_ids = tokenizer(prompt)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append({"input_ids": prompt_ids + completion_ids,
                    "labels": [IGNORE_INDEX] * len(prompt_ids) + completion_ids})
    return out


def to_device(batch: dict, device: torch.device) -> dict:
    """What accelerate's prepared loader does: tensors to the device, plain values (the counts) untouched."""
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets[0])


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_collator_counts_on_the_host_what_the_batch_holds(tokenizer, packing):
    rows = features(tokenizer)
    batch = make_collator(tokenizer, packing=packing)(rows)
    counts = batch[COUNTS]
    assert all(isinstance(counts[key], int) for key in COUNT_KEYS)
    assert counts["targets"] == sum(sum(label != IGNORE_INDEX for label in row["labels"][1:]) for row in rows)
    assert counts["targets"] == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert counts["tokens"] == sum(len(row["input_ids"]) for row in rows)
    assert counts["sequences"] == len(rows)
    if packing:
        assert counts["processed"] == counts["tokens"] == batch["input_ids"].shape[1]
    else:
        assert counts["tokens"] == int(batch["attention_mask"].sum()) < counts["processed"]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_collator_pads_to_the_multiple_and_counts_what_it_did_before(tokenizer, packing):
    """--pad_to_multiple_of 16 (fp8's): the row length a multiple of 16, the padding without targets, every count
    but the processed tokens as without it; a packed row's padding is one more sequence (flash's boundaries)."""
    rows = features(tokenizer)
    plain = make_collator(tokenizer, packing=packing)(rows)
    padded = make_collator(tokenizer, packing=packing, attn_implementation="flash_attention_2", multiple=16)(rows)
    length = plain["input_ids"].shape[1]
    assert length % 16 and padded["input_ids"].shape[1] == -(-length // 16) * 16
    assert {key: value for key, value in padded[COUNTS].items() if key != "processed"} == \
        {key: value for key, value in plain[COUNTS].items() if key != "processed"}
    assert padded[COUNTS]["processed"] == padded["input_ids"].numel()
    assert (padded["labels"][:, length:] == IGNORE_INDEX).all()
    if packing:
        lengths = [len(row["input_ids"]) for row in rows]
        boundaries = [0, *torch.tensor(lengths).cumsum(0).tolist(), padded["input_ids"].shape[1]]
        assert padded["cu_seq_lens_q"].tolist() == boundaries
        assert padded["position_ids"][0, length:].tolist() == list(range(padded["input_ids"].shape[1] - length))


def test_flash_attention_gets_sequence_boundaries_from_the_collator(tokenizer):
    """flash_attention_2 with packing: cu_seq_lens computed on the host, so no layer reads them back."""
    rows = features(tokenizer)
    batch = make_collator(tokenizer, packing=True, attn_implementation="flash_attention_2")(rows)
    lengths = [len(row["input_ids"]) for row in rows]
    assert batch["cu_seq_lens_q"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert batch["max_length_q"] == max(lengths)
    assert "cu_seq_lens_q" not in make_collator(tokenizer, packing=True)(rows)


# transformers' SDPA mask for a padded batch asks the device whether every position is real (one sync per forward,
# transformers' own): the forward is checked with eager attention there.
@pytest.mark.parametrize(("attn", "packing"), [("eager", False), ("eager", True), ("sdpa", True)])
def test_step_pieces_stay_on_the_device(tiny_assets, tokenizer, attn, packing):
    """The model's forward with the global target count on the device, the step's counts, and the one vector the
    ranks reduce, all on `meta`: no host tensor mixed in, nothing read back."""
    with torch.device(META):  # the model's structure; its buffers (rotary frequencies) on meta as well
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_assets[0]), dtype=torch.float32,
                                                 attn_implementation=attn)
    micro_batches = [to_device(make_collator(tokenizer, packing=packing)(features(tokenizer)), META)
                     for _ in range(2)]
    counts = take_counts(micro_batches)
    assert COUNTS not in micro_batches[0]  # the model must not receive it
    targets = torch.full((), counts["targets"], dtype=torch.long, device=META)
    loss = sum(model(**batch, num_items_in_batch=targets).loss for batch in micro_batches)
    assert loss.device == META
    for grad_norm in (torch.ones((), device=META), 1.5, float("inf"), None):
        norm = norm_on_device(grad_norm, META)
        out = StepOutput(loss=loss.detach(), grad_norm=norm, lr=1e-3)
        for is_main in (True, False):
            vector = step_vector(out, StepBatch(micro_batches, counts, next_targets=7), stop_requested=True,
                                 is_main_process=is_main)
            assert vector.device == META and vector.shape == (6 + len(COUNT_KEYS),)


def test_step_vector_sums_to_what_every_rank_must_know():
    """Over two ranks: any rank's non-finite loss or stop flag, the global loss, one copy of the global norm, and
    the next step's global target count."""
    counts = {"targets": 10, "tokens": 30, "processed": 40, "sequences": 4}
    ranks = [StepOutput(torch.tensor(1.25), torch.tensor(3.0), lr=1e-3),
             StepOutput(torch.tensor(float("nan")), torch.tensor(3.0), lr=1e-3)]
    summed = sum(step_vector(out, StepBatch([], counts, next_targets=11 + index), stop_requested=index == 0,
                             is_main_process=index == 0)
                 for index, out in enumerate(ranks))
    non_finite, stop, skipped, _, grad_norm, *totals, next_targets = summed.tolist()
    assert (non_finite, stop, skipped, grad_norm, totals, next_targets) == (
        1.0, 1.0, 0.0, 3.0, [20.0, 60.0, 80.0, 8.0], 23.0)
    finite = step_vector(StepOutput(torch.tensor(2.0), None, lr=1e-3), StepBatch([], counts, 0), False, True).tolist()
    assert finite[0] == 0.0 and finite[3] == 2.0  # no norm reported (DeepSpeed without one) is not an error


@pytest.mark.parametrize("loss_scaled", [False, True])
def test_an_overflow_under_a_loss_scaler_is_a_skipped_step(loss_scaled):
    """fp16's loss scaler skips a step whose gradients overflowed (an infinite norm) and lowers its scale: with
    one (`loss_scaled`) that step is counted as skipped, not stopped for; a non-finite loss stops either way. The
    norm sums to inf over the ranks, not to NaN (inf x 0 on the ranks that do not report it)."""
    counts = {"targets": 10, "tokens": 30, "processed": 40, "sequences": 4}
    overflow = [StepOutput(torch.tensor(1.25), torch.tensor(float("inf")), lr=1e-3)] * 2
    summed = sum(step_vector(out, StepBatch([], counts, 0), False, index == 0, loss_scaled)
                 for index, out in enumerate(overflow)).tolist()
    assert (summed[0] > 0, summed[2] > 0, summed[4]) == (not loss_scaled, loss_scaled, float("inf"))
    nan_loss = step_vector(StepOutput(torch.tensor(float("nan")), torch.tensor(1.0), lr=1e-3),
                           StepBatch([], counts, 0), False, True, loss_scaled).tolist()
    assert nan_loss[0] == 1.0 and nan_loss[2] == 0.0


def test_each_step_reports_the_learning_rate_its_update_used(tiny_assets, tokenizer):
    """The rate logged at step s is the one the optimizer applied in step s: with warm-up from 0, the first step
    reports 0, not the rate the scheduler moved on to after it (the value logged before was one step ahead)."""
    recipe = Recipe(learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="cosine", weight_decay=0.1)
    max_steps = 5
    reference = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=recipe.learning_rate)
    schedule = get_scheduler(recipe.lr_scheduler_type, reference, num_warmup_steps=2, num_training_steps=max_steps)
    expected = []
    for _ in range(max_steps):  # the rate each step applies: read before the scheduler moves on
        expected.append(schedule.get_last_lr()[0])
        reference.step()
        schedule.step()
    assert expected[:3] == [0.0, 5e-4, 1e-3]

    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)  # as parallel.distributed makes it
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32)
        model, optimizer, scheduler = accelerator.prepare(model, *make_optimizer(model, recipe, max_steps))
        batch = make_collator(tokenizer, packing=False)(features(tokenizer))
        counts = batch.pop(COUNTS)
        targets = torch.tensor(counts["targets"])
        rates = []
        for _ in range(max_steps):
            out = train_step(accelerator, model, optimizer, scheduler, [dict(batch)], targets,
                             BatchSizes(micro_batch=3, accumulation=1, world_size=1), max_grad_norm=1.0,
                             chunked_cross_entropy=True)
            rates.append(out.lr)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert rates == expected and all(isinstance(rate, float) for rate in rates)  # host numbers: no sync


class LargestFloat32(TorchDispatchMode):
    """The largest fp32 tensor any operation creates; with `vocab`, of those whose last dimension it is (logits)."""

    def __init__(self, vocab: int | None = None) -> None:
        super().__init__()
        self.numel, self.vocab = 0, vocab

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and (
                    self.vocab is None or tensor.shape[-1:] == (self.vocab,) and not func.is_view):
                self.numel = max(self.numel, tensor.numel())
        return out


def test_eval_statistics_equal_full_logits_without_an_fp32_copy_of_them():
    torch.manual_seed(0)
    rows, positions, vocab, chunk = 3, 37, 50, 8
    logits = torch.randn(rows, positions, vocab).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows, positions))
    labels[0, :10] = IGNORE_INDEX  # a prompt
    labels[2, 30:] = IGNORE_INDEX  # padding
    with LargestFloat32() as largest:
        chunked = row_statistics(logits, shifted_labels(labels), chunk=chunk)
    assert largest.numel <= chunk * vocab  # never a full-vocabulary fp32 copy of more than one chunk
    full = logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(full.transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                             reduction="none").sum(1)
    correct = ((full.argmax(-1) == targets) & mask).sum(1)
    torch.testing.assert_close(chunked, torch.stack([loss, mask.sum(1).float(), correct.float()], dim=1))
    assert row_statistics(logits.to(META), shifted_labels(labels).to(META), chunk=chunk).device == META


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_eval_statistics_come_from_the_head_a_chunk_at_a_time(precision):
    """The eval forward's head computes the statistics itself (evaluation.head_statistics): equal to those of the
    model's own full logits, with no fp32 tensor larger than one chunk of logits, under accelerate's autocast
    wrapper too, whose fp32 conversion of the model's outputs would copy the full logits."""
    from transformers import LlamaForCausalLM

    from shardtune.models.tiny_assets import tiny_llama_config

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    torch.manual_seed(0)
    model = accelerator.prepare_model(LlamaForCausalLM(tiny_llama_config(500)).eval())
    input_ids = torch.randint(3, 500, (3, 37))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, 30:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[0, :10] = IGNORE_INDEX
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        assert logits.dtype == torch.float32  # accelerate's wrapper: the full copy head_statistics never makes
        with LargestFloat32(vocab=500) as largest:
            statistics = head_statistics(model, accelerator.unwrap_model(model), batch, chunk=8)
    assert 0 < largest.numel <= 8 * 500
    expected = row_statistics(logits.to(torch.bfloat16) if precision == "bf16" else logits, shifted_labels(labels),
                              chunk=8)
    torch.testing.assert_close(statistics, expected, rtol=1e-6 if precision == "no" else 1e-3, atol=0)
    AcceleratorState._reset_state(True)


def test_an_fsdp2_sharded_head_is_a_plain_head():
    """fully_shard turns lm_head into an FSDPLinear subclass whose forward is Linear's: still computed in chunks
    (type() is nn.Linear was False there, and every FSDP eval took the full logits). One rank over gloo, in a
    process of its own."""
    import subprocess
    import sys

    from tests.conftest import REPO, free_port

    code = f"""
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaForCausalLM
from shardtune.evaluation import plain_head
from shardtune.models.tiny_assets import tiny_llama_config
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
model = LlamaForCausalLM(tiny_llama_config(100))
fully_shard([model.model.norm, model.lm_head])
fully_shard(model)
print(type(model.lm_head).__name__, plain_head(model))
dist.destroy_process_group()
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.split()[-2:] == ["FSDPLinear", "True"], result.stderr[-2000:]


def test_eval_of_a_head_with_an_adapter_reads_its_full_logits():
    """A LoRA adapter on lm_head (allowed with --chunked_cross_entropy false) is part of the logits: head_statistics
    would read the base weight alone, so evaluate takes the model's own logits there (plain_head)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from shardtune.evaluation import evaluate, plain_head
    from shardtune.models.tiny_assets import tiny_llama_config

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(500))
    assert plain_head(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    assert not plain_head(model)
    input_ids = torch.randint(3, 500, (2, 20))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
    with torch.no_grad():
        expected = row_statistics(model(input_ids=input_ids).logits, shifted_labels(batch["labels"])).sum(0)
        adapterless = head_statistics(model, model, batch).sum(0)
    result = evaluate(model, [{**batch, COUNTS: {}}], accelerator)
    assert result["eval_loss"] == pytest.approx((expected[0] / expected[1]).item(), rel=1e-6)
    assert abs(adapterless[0] - expected[0]) > 1e-3 * expected[0]  # the adapter counts
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize(("attn", "packing", "on_gpu", "message"), [
    ("flash_attn_2", False, True, "--attn_implementation 'flash_attn_2' is unknown"),
    ("flash_attention_2", False, False, "runs on CUDA GPUs only"),
    ("flash_attention_2", True, True, "needs the flash_attn package"),
    ("flex_attention", False, False, "no backward pass on CPU"),
    ("sdpa", True, True, "builds a dense mask over the whole packed row"),
    ("eager", True, True, "builds a dense mask over the whole packed row"),
])
def test_attention_refused_before_loading(attn, packing, on_gpu, message):
    with pytest.raises(ConfigError, match=message):
        check_attention(Recipe(attn_implementation=attn, packing=packing), on_gpu=on_gpu)


@pytest.mark.parametrize(("attn", "packing", "on_gpu"), [
    ("sdpa", False, True), ("sdpa", True, False), ("flex_attention", True, True), ("eager", False, False),
])
def test_attention_accepted(attn, packing, on_gpu):
    check_attention(Recipe(attn_implementation=attn, packing=packing), on_gpu=on_gpu)


def test_each_step_sees_its_own_counts_and_the_next_steps():
    """The next step's target count rides in this step's all-reduce: `counted_steps` hands both over, in order,
    and takes the counts out of the batches the model will see."""
    steps = [[{"input_ids": step, COUNTS: {key: step * 10 + micro for key in COUNT_KEYS}} for micro in (1, 2)]
             for step in range(1, 5)]
    seen = list(counted_steps(iter(steps)))
    assert [batch.counts["targets"] for batch in seen] == [23, 43, 63]  # (s*10+1) + (s*10+2)
    assert [batch.next_targets for batch in seen] == [43, 63, 83]
    assert all(COUNTS not in micro_batch for batch in seen for micro_batch in batch.micro_batches)

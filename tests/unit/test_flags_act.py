"""A flag that is accepted acts: each test builds the real object a recipe flag feeds (the process group, the
optimizer, the scheduler, the loaders, the model, the W&B run, the tokenized splits) from a recipe that sets the
flag away from its default, and reads the value back from that object, so that a flag that stops reaching its
consumer fails here. The trainer's own pieces run in this process as one rank of a one-rank gloo group."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
from datetime import timedelta
from types import SimpleNamespace

import datasets
import pytest
import torch
import torch.distributed as dist
import wandb
from accelerate.state import AcceleratorState
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer
from transformers.modeling_layers import GradientCheckpointingLayer

from shardtune.checkpoint.run_settings import ResumePoint
from shardtune.checks.startup import batch_sizes
from shardtune.config import BatchSizes, ConfigError, Recipe
from shardtune.data.batches import COUNTS
from shardtune.data.loading import load_splits
from shardtune.data.sources import check_dataset_sources
from shardtune.flags import parse_recipe
from shardtune.launch import LaunchDescription
from shardtune.model import load_model
from shardtune.models.tiny_assets import reversal_examples
from shardtune.parallel.distributed import configure_deepspeed, make_accelerator
from shardtune.step import train_step
from shardtune.tracking import wandb_init_kwargs
from shardtune.trainer import build, start
from tests.conftest import load_script

ROWS = reversal_examples(96, seed=3)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gloo_timeout() -> timedelta:
    """The timeout of this rank's default process group, as its gloo backend holds it."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("flags-data") / "rows.jsonl"
    Dataset.from_list(ROWS).to_json(str(path))
    return str(path)


def one_rank_recipe(tiny_assets, data_file: str, output_dir: str, **overrides) -> Recipe:
    """A tiny run with every flag under test away from its default."""
    values = dict(
        name="flags", model_name_or_path=tiny_assets[0], dataset=data_file, output_dir=output_dir, use_cpu=True,
        mixed_precision="no", max_seq_length=64, per_device_train_batch_size=4, global_batch_size=8,
        max_steps=-1, num_train_epochs=3, per_device_eval_batch_size=3, eval_fraction=0.25,
        learning_rate=2e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.97, adam_epsilon=1e-6,
        lr_scheduler_type="linear", warmup_ratio=0.0, gradient_checkpointing=True, gradient_checkpointing_interval=2,
        seed=7, report_to="wandb", wandb_project="flags-project", run_name="flags-run", generation_samples=0,
        collective_timeout_minutes=3, startup_timeout_minutes=11, pad_to_multiple_of=24,
    )
    return Recipe(**{**values, **overrides})


# Before the one-rank fixture's tests: it makes Accelerators of its own, and accelerate's state is process-wide.
def test_seed_draws_the_split_the_data_order_and_the_lora_init(tiny_assets, data_file, tmp_path):
    """--seed: which rows are held out, the order the training rows come in, and the adapters' initial values;
    the same seed gives the same run."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    held_out = [load_splits(Recipe(dataset=data_file, seed=seed, eval_fraction=0.25), tokenizer)[1]["input_ids"]
                for seed in (7, 7, 8)]
    assert held_out[0] == held_out[1] != held_out[2]

    def first_batch_and_adapter(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        # every row trains (--eval_split), so only the order can differ
        recipe = one_rank_recipe(tiny_assets, data_file, str(tmp_path), seed=seed, eval_split=data_file,
                                 use_peft=True, report_to="none")
        accelerator = make_accelerator(recipe, batch_sizes(recipe, 1), LaunchDescription(), log_with=None)
        try:
            run = build(accelerator, recipe, batch_sizes(recipe, 1))
            adapter = next(param for name, param in run.model.named_parameters() if "lora_A" in name)
            return next(iter(run.train_loader))["input_ids"], adapter.detach().clone()
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)

    (batch, adapter), (same_batch, same_adapter), (other_batch, other_adapter) = map(first_batch_and_adapter,
                                                                                     (7, 7, 8))
    assert torch.equal(batch, same_batch) and torch.equal(adapter, same_adapter)
    assert not torch.equal(batch, other_batch) and not torch.equal(adapter, other_adapter)


@pytest.fixture(scope="module")
def one_rank(tiny_assets, data_file, tmp_path_factory):
    """make_accelerator, build and start as `train` runs them, in a one-rank gloo group, W&B offline; then the
    state the trainer's steps run on."""
    output_dir = str(tmp_path_factory.mktemp("flags-run"))
    recipe = one_rank_recipe(tiny_assets, data_file, output_dir)
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WANDB_MODE": "offline",
                            "WANDB_SILENT": "true"}.items():
            env.setenv(name, value)
        env.delenv("WANDB_API_KEY", raising=False)
        launch = LaunchDescription.from_env()
        batching = batch_sizes(recipe, launch.world_size)
        accelerator = make_accelerator(recipe, batching, launch, log_with="wandb")
        try:
            startup_timeout = gloo_timeout()
            run = build(accelerator, recipe, batching)
            start(accelerator, recipe, batching, launch, run, ResumePoint())
            yield SimpleNamespace(recipe=recipe, accelerator=accelerator, run=run, startup_timeout=startup_timeout,
                                  collective_timeout=gloo_timeout(), tracker=accelerator.get_tracker("wandb",
                                                                                                     unwrap=True))
        finally:
            accelerator.end_training()
            wandb.teardown()  # W&B's service process, which would otherwise outlive the test session
            if dist.is_initialized():
                dist.destroy_process_group()
            AcceleratorState._reset_state(reset_partial_state=True)


def test_timeouts_reach_the_process_group(one_rank):
    """--startup_timeout_minutes is the group's timeout while the model loads; --collective_timeout_minutes once
    training starts."""
    assert one_rank.startup_timeout == timedelta(minutes=11)
    assert one_rank.collective_timeout == timedelta(minutes=3)


def test_optimizer_takes_the_adamw_flags(one_rank):
    groups = one_rank.run.optimizer.param_groups
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]  # matrices, then norms
    assert all((group["lr"], group["betas"], group["eps"]) == (2e-3, (0.8, 0.97), 1e-6) for group in groups)


def test_epochs_set_the_run_length_and_the_schedule(one_rank):
    """--max_steps -1: --num_train_epochs epochs of the training split; the linear schedule reaches 0 there."""
    run = one_rank.run
    train_rows = len(ROWS) - round(0.25 * len(ROWS))
    assert run.steps_per_epoch == train_rows // 8 and run.max_steps == 3 * run.steps_per_epoch
    decay = run.scheduler.scheduler.lr_lambdas[0]
    assert decay(run.max_steps - 1) > 0 and decay(run.max_steps) == 0


def test_eval_micro_batches_hold_the_eval_batch_size(one_rank):
    sizes = [len(batch["input_ids"]) for batch in one_rank.run.eval_loader]
    assert sizes[0] == 3 and sum(sizes) == round(0.25 * len(ROWS))


def test_training_and_eval_batches_are_padded_to_the_multiple(one_rank):
    lengths = {batch["input_ids"].shape[1] for loader in (one_rank.run.train_loader, one_rank.run.eval_loader)
               for batch in loader}
    assert lengths and all(length % 24 == 0 for length in lengths)


def test_every_interval_th_layer_recomputes(one_rank):
    layers = [module for module in one_rank.run.model.modules() if isinstance(module, GradientCheckpointingLayer)]
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]


def test_wandb_run_is_named_and_filed_under_the_project(one_rank):
    tracker = one_rank.tracker
    assert (tracker.project, tracker.name) == ("flags-project", "flags-run")
    with open(f"{one_rank.recipe.output_dir}/run_config.json") as file:
        assert json.load(file)["recipe"]["run_name"] == "flags-run"


def test_run_name_defaults_to_the_recipe_name():
    kwargs = wandb_init_kwargs(Recipe(name="tiny", output_dir="out"), run_id="abc")
    assert kwargs["name"] == "tiny" and kwargs["dir"] == "out" and kwargs["id"] == "abc"


def test_dataset_split_picks_the_training_split(tmp_path, tiny_assets):
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    saved = str(tmp_path / "saved")
    DatasetDict({"train": Dataset.from_list(ROWS[:48]), "other": Dataset.from_list(ROWS[48:])}).save_to_disk(saved)
    train, evaluation = load_splits(Recipe(dataset=saved, dataset_split="other", eval_split="train"), tokenizer)
    _, other = load_splits(Recipe(dataset=saved, eval_split="other"), tokenizer)  # "other" tokenized as it is
    assert (len(train), len(evaluation)) == (len(ROWS) - 48, 48) and train["input_ids"] == other["input_ids"]


def test_dataset_split_of_a_one_split_source_is_refused(data_file, tmp_path):
    single = str(tmp_path / "single")
    Dataset.from_list(ROWS).save_to_disk(single)
    for source in (data_file, single):
        with pytest.raises(ConfigError, match=r"--dataset_split 'validation': .* has one split"):
            check_dataset_sources(Recipe(dataset=source, dataset_split="validation"))
        check_dataset_sources(Recipe(dataset=source))  # its one split is "train"


def test_dataset_num_proc_tokenizes_in_that_many_processes(tiny_assets, tmp_path):
    """Each process of `Dataset.map` writes its own cache shard (a file of its own for each count: no cache hit)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    shards = {}
    for count in (1, 2):
        path = str(tmp_path / f"rows-{count}.jsonl")
        Dataset.from_list(ROWS).to_json(path)
        train, _ = load_splits(Recipe(dataset=path, eval_split=path, dataset_num_proc=count), tokenizer)
        shards[count] = len(train.cache_files)
    assert shards == {1: 1, 2: 2}


def test_negations_switch_their_flag_off(tiny_assets):
    recipe = parse_recipe(Recipe(), ["--no_completion_only_loss", "--no_gradient_checkpointing", "--no_save_model"])
    assert (recipe.completion_only_loss, recipe.gradient_checkpointing, recipe.save_model) == (False, False, False)
    model = load_model(dataclasses.replace(recipe, model_name_or_path=tiny_assets[0], mixed_precision="no"))
    assert not any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    assert load_model(Recipe(model_name_or_path=tiny_assets[0], mixed_precision="no",
                             gradient_checkpointing_interval=2)).model.layers[0].gradient_checkpointing


def test_lora_flags_shape_the_adapters(tiny_assets):
    model = load_model(Recipe(model_name_or_path=tiny_assets[0], mixed_precision="no", use_peft=True, lora_r=4,
                              lora_alpha=12, lora_dropout=0.2, lora_target_modules="q_proj,v_proj"))
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, param in model.named_parameters()
               if param.requires_grad}
    assert adapted == {"q_proj", "v_proj"}
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.lora_A["default"].weight.shape[0] == 4 and layer.scaling["default"] == 12 / 4
    assert layer.lora_dropout["default"].p == 0.2


@pytest.mark.parametrize("max_grad_norm", [0.5, 0.01, 0.0])
def test_gradients_are_clipped_to_max_grad_norm(one_rank, max_grad_norm):
    """train_step clips to the norm it is given (SGD at rate 1: the update is the clipped gradient), and 0 clips
    nothing, as in transformers (torch's clipping would zero every gradient); DeepSpeed, which clips inside its
    own step (0: not at all), gets --max_grad_norm in its config."""
    run, accelerator = one_rank.run, one_rank.accelerator
    parameters = [param for param in run.model.parameters() if param.requires_grad]
    before = [param.detach().clone() for param in parameters]
    optimizer = torch.optim.SGD(parameters, lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    loader = iter(run.train_loader)
    micro_batches = [next(loader) for _ in range(2)]
    targets = torch.tensor(sum(batch.pop(COUNTS)["targets"] for batch in micro_batches))
    out = train_step(accelerator, run.model, optimizer, schedule, micro_batches, targets, BatchSizes(4, 2, 1),
                     max_grad_norm, chunked_cross_entropy=one_rank.recipe.chunked_cross_entropy)
    update = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(param.detach() - old)
                                                   for param, old in zip(parameters, before, strict=True)]))
    if max_grad_norm > 0:
        assert out.grad_norm > max_grad_norm and update.item() == pytest.approx(max_grad_norm, rel=1e-3)
    else:
        assert update.item() > 0 and update.item() == pytest.approx(float(out.grad_norm), rel=1e-4)
    with torch.no_grad():
        for param, old in zip(parameters, before, strict=True):
            param.copy_(old)
    config = {"zero_optimization": {"stage": 3}}
    configure_deepspeed(config, dataclasses.replace(one_rank.recipe, max_grad_norm=max_grad_norm))
    assert config["gradient_clipping"] == max_grad_norm


def test_prepare_data_benchmark_times_the_rows_and_file_asked_for(tiny_assets, data_file, tmp_path, capsys):
    """scripts/prepare_data.py --benchmark_rows N --benchmark_file F: N rows of F (short reversal rows), not the
    synthetic instruction-sized ones it takes without F."""
    recipe_file = tmp_path / "recipe.py"
    recipe_file.write_text(f"from shardtune import Recipe\nRECIPE = Recipe(model_name_or_path={tiny_assets[0]!r})\n")
    prepare_data = load_script("prepare_data")
    try:
        assert prepare_data.main([str(recipe_file), "--benchmark_rows", "24", "--benchmark_file", data_file]) == 0
        from_file = capsys.readouterr().out
        assert prepare_data.main([str(recipe_file), "--benchmark_rows", "8"]) == 0
        synthetic = capsys.readouterr().out
    finally:
        datasets.enable_caching()  # the benchmark turns the cache off for the whole process

    def rows_and_tokens(out: str) -> tuple[int, int]:
        rows, tokens = re.search(r"prepare_data: (\d+) rows, ([\d,]+) tokens a row", out).groups()
        return int(rows), int(tokens.replace(",", ""))

    (file_rows, file_tokens), (synthetic_rows, synthetic_tokens) = map(rows_and_tokens, (from_file, synthetic))
    assert (file_rows, synthetic_rows) == (24, 8) and file_tokens < 40 < synthetic_tokens

"""An output directory belongs to one live run: the lock rank 0 holds (checkpoint.output_dir) against a second run,
taken over with a line once its holder is gone, and kept by --overwrite_output_dir's clearing; and `auto` or a
path that cannot be resumed from is refused with what to give instead (shardtune.checkpoint.markers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from shardtune.checkpoint.markers import describe_files, resolve_resume, write_marker
from shardtune.checkpoint.output_dir import LOCK_FILE, OutputDirLock, in_use
from shardtune.checkpoint.run_files import clear_output_dir, strangers
from shardtune.checks.outputs import check_checkpoints, check_output_dir
from shardtune.config import ConfigError, Recipe

HOLD = "import sys, time; from shardtune.checkpoint.output_dir import OutputDirLock; " \
       "OutputDirLock(sys.argv[1]).acquire(False); print('held', flush=True); time.sleep(600)"


def hold(output_dir) -> subprocess.Popen:
    """Another run's rank 0: a real process holding the lock until it is killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(output_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_live_run_keeps_its_directory_and_a_dead_one_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    output_dir = tmp_path / "out"
    holder = hold(output_dir)
    try:
        (output_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        assert f"pid {holder.pid} on " in in_use(str(output_dir))
        for overwrite in (False, True):  # both refused by the check every launch runs, before anything loads
            with pytest.raises(ConfigError, match=f"is in use by a live run \\(pid {holder.pid} on .*-c") as error:
                check_output_dir(Recipe(output_dir=str(output_dir), overwrite_output_dir=overwrite,
                                        resume_from_checkpoint="" if overwrite else "auto"))
            assert ("never touches a live run's files" in str(error.value)) == overwrite
        with pytest.raises(ConfigError, match="is in use by a live run"):  # the lock itself, should a check race
            OutputDirLock(str(output_dir)).acquire(overwrite=True)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert in_use(str(output_dir)) is None
    lock = OutputDirLock(str(output_dir))
    note = lock.acquire(overwrite=False)
    assert f"was held by a run that ended without closing (pid {holder.pid} on " in note and "taking it over" in note
    assert json.loads((output_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    clear_output_dir(str(output_dir))  # --overwrite_output_dir: the earlier run's files go, the lock stays
    assert os.listdir(output_dir) == [LOCK_FILE]
    lock.release()
    assert (output_dir / LOCK_FILE).read_text() == ""  # a clean end: the next run takes it without a word
    assert OutputDirLock(str(output_dir)).acquire(overwrite=False) is None


def test_two_runs_started_together_one_is_refused(tmp_path):
    """Two launches into one new directory at the same moment: exactly one holds it."""
    output_dir = tmp_path / "out"
    code = ("import sys, time; from shardtune.config import ConfigError; "
            "from shardtune.checkpoint.output_dir import OutputDirLock"
            "\ntry:\n    OutputDirLock(sys.argv[1]).acquire(False); print('held', flush=True); time.sleep(3)"
            "\nexcept ConfigError as error:\n    print(error, flush=True)")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(output_dir)], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = sorted(run.communicate(timeout=60)[0].strip() for run in runs)
    assert outputs[1] == "held" and "is in use by a live run" in outputs[0], outputs


def test_resume_paths_that_are_no_checkpoint_say_what_to_give(tmp_path):
    output_dir = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"auto found nothing to resume: --output_dir .*/out' does not exist"):
        resolve_resume("auto", str(output_dir), 1)
    output_dir.mkdir()
    (output_dir / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"auto found nothing to resume: --output_dir .* holds no run"):
        resolve_resume("auto", str(output_dir), 1)
    (output_dir / LOCK_FILE).write_text("")  # a run was started here and saved nothing: it starts again
    assert resolve_resume("auto", str(output_dir), 1) == (None, 0)

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"'.*/data' is not a checkpoint \(no checkpoint_complete.json"):
        resolve_resume(str(data), str(output_dir), 1)
    unfinished = output_dir / "checkpoint-6"
    unfinished.mkdir()
    with pytest.raises(ConfigError, match="is not a complete checkpoint .*its save did not finish"):
        resolve_resume(str(unfinished), str(output_dir), 1)
    complete = output_dir / "checkpoint-4"
    complete.mkdir()
    write_marker(str(complete), {"step": 4, "world_size": 1, "files": {}})
    with pytest.raises(ConfigError, match=r"is a run's output directory, not a checkpoint: give one of its checkpoint-"
                                          r"<step> directories \(the newest complete one is .*checkpoint-4\)"):
        resolve_resume(str(output_dir), str(output_dir), 1)
    assert resolve_resume(str(complete), str(output_dir), 1) == (str(complete), 4)


def test_auto_with_overwrite_is_refused():
    with pytest.raises(ConfigError, match="auto resumes the run in --output_dir and --overwrite_output_dir true "
                                          "deletes it"):
        check_checkpoints(Recipe(resume_from_checkpoint="auto", overwrite_output_dir=True))


def test_a_checkpoint_resumes_only_under_its_own_sharding_and_length():
    """The strategy and ZeRO stage a checkpoint was written under (each writes its own layout), and a run's
    length: carried over on the constant schedule, refused past the checkpoint's step; from epochs, the data must
    give the same length again."""
    from shardtune.checkpoint.run_settings import check_resume_settings, check_resumed_length, run_settings
    from shardtune.config import BatchSizes
    from shardtune.launch import LaunchDescription

    batching = BatchSizes(micro_batch=2, accumulation=2, world_size=2)
    fsdp = LaunchDescription(world_size=2, uses_fsdp=True)
    zero3 = LaunchDescription(world_size=2, uses_deepspeed=True, deepspeed_settings={"stage": 3})
    zero2 = LaunchDescription(world_size=2, uses_deepspeed=True, deepspeed_settings={"stage": 2})
    recipe = Recipe(max_steps=10, lr_scheduler_type="constant", warmup_ratio=0)
    saved = {**run_settings(recipe, fsdp, batching), "max_steps": 10}
    with pytest.raises(ConfigError, match="saved under FSDP2 and this launch is DeepSpeed ZeRO-3"):
        check_resume_settings("ckpt", 4, saved, run_settings(recipe, zero3, batching))
    saved_zero3 = {**run_settings(recipe, zero3, batching), "max_steps": 10}
    with pytest.raises(ConfigError, match="saved under DeepSpeed ZeRO-3 and this launch is DeepSpeed ZeRO-2"):
        check_resume_settings("ckpt", 4, saved_zero3, run_settings(recipe, zero2, batching))
    longer = Recipe(max_steps=20, lr_scheduler_type="constant", warmup_ratio=0)
    assert check_resume_settings("ckpt", 4, saved, run_settings(longer, fsdp, batching)) == [
        "training to step 20 where the checkpoint's run went to 10 (the constant schedule is the same)"]
    assert check_resume_settings("ckpt", 4, {}, run_settings(longer, zero3, batching)) == []  # an older marker

    # Another tp_size: FSDP2's sharded state reshards (tests/launch/test_tensor_parallel.py), TP alone is refused.
    fsdp_tp = LaunchDescription(world_size=2, uses_fsdp=True, tp_size=2)
    assert check_resume_settings("ckpt", 4, saved, run_settings(recipe, fsdp_tp, batching)) == [
        "tensor parallelism over 2 rank(s) where the checkpoint had 1: torch.distributed.checkpoint reshards its "
        "FSDP2 states"]
    saved_tp_alone = {**run_settings(recipe, LaunchDescription(world_size=2, tp_size=2), batching), "max_steps": 10}
    with pytest.raises(ConfigError, match="saved with tp_size 2 and this launch has tp_size 1") as error:
        check_resume_settings("ckpt", 4, saved_tp_alone, run_settings(recipe, LaunchDescription(world_size=2),
                                                                      batching))
    assert "\n" not in error.value.messages[0]

    by_epochs = {**run_settings(Recipe(), fsdp, batching), "max_steps": 30}
    check_resumed_length("ckpt", by_epochs, 30)
    with pytest.raises(ConfigError, match="trained for 30 steps and this run's data makes 28: the data changed"):
        check_resumed_length("ckpt", by_epochs, 28)


# ------------------------------------------------------------------------------- --overwrite_output_dir's rule


def tree(root) -> dict[str, bytes | None]:
    """Every entry under `root`, hidden ones included, with its content (None: a directory)."""
    return {str(path.relative_to(root)): None if path.is_dir() else path.read_bytes()
            for path in sorted(root.rglob("*"))}


def overwrite_refusal(tiny_assets, output_dir, capsys, monkeypatch) -> str:
    """The tiny recipe's entry point in this process with --overwrite_output_dir true into `output_dir`: exit code
    2 and one error line, returned. A run let through fails the test at the trainer."""
    from shardtune.cli import main

    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or \
                name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)

    def reached_the_trainer(*args, **kwargs):
        raise AssertionError("not refused: the run reached the trainer")

    monkeypatch.setattr("shardtune.trainer.train", reached_the_trainer)
    argv = ["--model_name_or_path", tiny_assets[0], "--dataset", tiny_assets[1], "--output_dir", str(output_dir),
            "--report_to", "none", "--use_cpu", "true", "--overwrite_output_dir", "true"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(Recipe(name="tiny", max_seq_length=64, per_device_train_batch_size=16, global_batch_size=32), argv)
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.startswith("shardtune: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    return lines[0]


DOTFILES = {".bashrc": "alias ll='ls -l'\n", ".ssh/id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY-----\n",
            ".config/app.toml": "x = 1\n"}
REPOSITORY = {".git/HEAD": "ref: refs/heads/main\n", ".git/config": "[core]\n"}


@pytest.mark.parametrize("files", [DOTFILES, REPOSITORY], ids=["dotfiles", "git"])
def test_overwrite_leaves_a_directory_of_hidden_entries_untouched(files, tiny_assets, tmp_path, capsys, monkeypatch):
    """A directory holding only dot-entries (a home's .bashrc, .ssh, .config) or only a .git was emptied with exit
    0: the start-up check skipped dot-names and the clearing deleted everything. Both are refused, in one line
    naming what is there, and stay as they were; the clearing itself deletes none of it either."""
    output_dir = tmp_path / "out"
    for name, content in files.items():
        (output_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (output_dir / name).write_text(content)
    before = tree(output_dir)
    line = overwrite_refusal(tiny_assets, output_dir, capsys, monkeypatch)
    if files is DOTFILES:
        assert "also holds 3 entries no run wrote (.bashrc, .config, .ssh): move them out" in line, line
    else:
        assert "which is the root of a repository (it holds .git): it is never cleared" in line, line
    assert tree(output_dir) == before
    assert clear_output_dir(str(output_dir)) == ([] if files is REPOSITORY else [".bashrc", ".config", ".ssh"])
    assert tree(output_dir) == before


def test_overwrite_never_clears_home_root_repository_or_the_working_directory(tmp_path, monkeypatch):
    """Each holds nothing but an earlier run's metrics, and is refused for what it is."""
    def refusal(output_dir) -> str:
        with pytest.raises(ConfigError) as error:
            check_output_dir(Recipe(output_dir=str(output_dir), overwrite_output_dir=True))
        assert len(error.value.messages) == 1
        return error.value.messages[0]

    run = {"metrics.jsonl": '{"step": 1}\n', LOCK_FILE: ""}
    home, repository, work = tmp_path / "home", tmp_path / "repo", tmp_path / "work"
    for directory in (home, repository, work):
        directory.mkdir()
        for name, content in run.items():
            (directory / name).write_text(content)
    (repository / ".git").write_text("gitdir: ../elsewhere\n")  # a worktree's or submodule's .git is a file
    monkeypatch.setenv("HOME", str(home))
    assert "which is the home directory: it is never cleared" in refusal(home)
    assert "which is the home directory" in refusal(tmp_path / "home" / ".." / "home")  # compared resolved
    assert "which is the root of the filesystem" in refusal("/")
    assert "which is the root of a repository (it holds .git)" in refusal(repository)
    monkeypatch.chdir(work)
    assert "which is the working directory" in refusal(work)
    assert "which is the working directory" in refusal(".")
    (work / "sub").mkdir()
    monkeypatch.chdir(work / "sub")
    assert "which holds the working directory" in refusal(work)
    monkeypatch.chdir(tmp_path)
    check_output_dir(Recipe(output_dir=str(work / "sub"), overwrite_output_dir=True))  # empty: nothing to clear
    (work / "sub").rmdir()
    check_output_dir(Recipe(output_dir=str(work), overwrite_output_dir=True))  # a run's own: replaced
    for directory in (home, repository, work):
        assert (directory / "metrics.jsonl").is_file()  # the checks delete nothing


def test_overwrite_clears_every_file_a_run_writes_and_nothing_else(tmp_path):
    """An earlier run's files of every kind go (the lock stays: this run holds it); a file put in its checkpoint,
    or any other entry, makes the directory refused and stays where the clearing meets it."""
    output_dir = tmp_path / "out"
    checkpoint = output_dir / "checkpoint-2"
    (checkpoint / "pytorch_model_fsdp_0").mkdir(parents=True)
    (checkpoint / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"shard")
    (checkpoint / "config.json").write_text("{}")
    write_marker(str(checkpoint), {"step": 2, "world_size": 1, "files": describe_files(str(checkpoint))})
    written = {LOCK_FILE: "", "metrics.jsonl": "{}\n", "samples.jsonl": "{}\n", "run_config.json": "{}",
               "wandb_run_id": "abcd1234", "metrics.png": "png", "config.json": "{}", "generation_config.json": "{}",
               "model-00001-of-00002.safetensors": "w", "model-00002-of-00002.safetensors": "w",
               "model.safetensors.index.json": "{}", "tokenizer.json": "{}", "tokenizer_config.json": "{}",
               "chat_template.jinja": "{{ x }}", "adapter_model.safetensors": "w", "adapter_config.json": "{}",
               "README.md": "---\nlibrary_name: peft\nbase_model: x\n---\n# Model card\n",
               "wandb/offline-run-20261207_181309-abcd1234/run-abcd1234.wandb": "w",
               "reference_log_probs/train.pt": "t",
               "checkpoint-4/optimizer.bin": "unfinished save", ".checkpoint-6.tmp/model.safetensors": "crashed",
               ".shardtune-shared-" + "0" * 32: "probe"}
    for name, content in written.items():
        (output_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (output_dir / name).write_text(content)
    assert strangers(str(output_dir)) == []
    check_output_dir(Recipe(output_dir=str(output_dir), overwrite_output_dir=True))
    assert clear_output_dir(str(output_dir)) == []
    assert os.listdir(output_dir) == [LOCK_FILE]

    # Strangers: a file added to a marked checkpoint, a README of one's own, a link, a hidden file.
    (output_dir / "checkpoint-2").mkdir()
    write_marker(str(output_dir / "checkpoint-2"), {"step": 2, "world_size": 1, "files": {}})
    (output_dir / "checkpoint-2" / "notes.txt").write_text("mine")
    (output_dir / "README.md").write_text("# My experiments\n")
    (output_dir / "data").symlink_to(tmp_path)
    (output_dir / ".env").write_text("TOKEN=x")
    (output_dir / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"also holds 4 entries no run wrote \(.env, README.md, "
                                          r"checkpoint-2/notes.txt and 1 more\): move them out, or give "
                                          r"--output_dir a directory of the run's own"):
        check_output_dir(Recipe(output_dir=str(output_dir), overwrite_output_dir=True))
    assert strangers(str(output_dir)) == [".env", "README.md", "checkpoint-2", "data"]
    # Put there after the check: the clearing keeps them, says so, and takes the run's file alone.
    assert clear_output_dir(str(output_dir)) == [".env", "README.md", "checkpoint-2", "data"]
    assert sorted(os.listdir(output_dir)) == sorted([".env", "README.md", "checkpoint-2", "data", LOCK_FILE])
    assert (output_dir / "checkpoint-2" / "notes.txt").read_text() == "mine" and os.listdir(tmp_path / "out" / "data")


def test_overwrite_refuses_a_model_directory_no_run_wrote(tmp_path):
    """A Hugging Face model's files have the export's names; without a run's lock, metrics or checkpoint they are
    someone's downloaded or exported model, and stay."""
    model = tmp_path / "llama"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    before = tree(model)
    with pytest.raises(ConfigError, match=r"holds none \(no .shardtune-lock, no checkpoint with "
                                          r"checkpoint_complete.json\) but "
                                          r"config.json, generation_config.json, model.safetensors and 1 more: give "):
        check_output_dir(Recipe(output_dir=str(model), overwrite_output_dir=True))
    assert tree(model) == before


def test_a_new_run_refuses_a_strangers_directory_without_pointing_to_overwrite(tmp_path):
    """--overwrite_output_dir true would refuse it too: the fix named is a new directory."""
    output_dir = tmp_path / "out"
    (output_dir / "src").mkdir(parents=True)
    (output_dir / "NOTES.txt").write_text("notes")
    with pytest.raises(ConfigError, match=r"already holds NOTES.txt, src, which no run wrote: give a new or empty "
                                          r"directory\.$"):
        check_output_dir(Recipe(output_dir=str(output_dir)))


# A crashed Hugging Face Trainer or TRL run: checkpoint-<step> folders, none with shardtune's marker, no lock.
TRAINER_FILES = {"checkpoint-500/trainer_state.json": '{"global_step": 500}', "checkpoint-500/model.safetensors": "w",
                 "checkpoint-1000/optimizer.pt": "o"}


def write_files(root, files: dict[str, str]) -> None:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)


def test_another_trainers_checkpoints_are_refused_and_untouched(tiny_assets, tmp_path, capsys, monkeypatch):
    """Unmarked checkpoint-<step> folders were taken for an unfinished save of the run's: emptied by
    --overwrite_output_dir, and --overwrite_output_dir was the fix a new run named. Every path now says whose they
    are, names a fix that works, and deletes nothing."""
    from shardtune.checkpoint.markers import holds_a_run

    output_dir = tmp_path / "out"
    write_files(output_dir, TRAINER_FILES)
    before = tree(output_dir)
    what = (f"--output_dir '{output_dir}' holds checkpoint-1000, checkpoint-500 with no checkpoint_complete.json and "
            "no .shardtune-lock beside them: another trainer's checkpoints, which shardtune neither resumes nor "
            "deletes")
    assert overwrite_refusal(tiny_assets, output_dir, capsys, monkeypatch) == (
        f"shardtune: error: --overwrite_output_dir true deletes only what a shardtune run wrote, and {what}. Give "
        "--output_dir a directory of the run's own.")
    with pytest.raises(ConfigError) as error:
        check_output_dir(Recipe(output_dir=str(output_dir)))
    assert error.value.messages == [f"{what}. Give --output_dir a new or empty directory."]
    (output_dir / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as error:
        check_output_dir(Recipe(output_dir=str(output_dir)))
    assert error.value.messages == [f"{what}; it also holds notes.txt, which no run wrote. Give --output_dir a new or "
                                    "empty directory."]
    (output_dir / "notes.txt").unlink()
    elsewhere = tmp_path / "run" / "checkpoint-4"  # a resume into it: its saves would replace them as unfinished
    elsewhere.mkdir(parents=True)
    write_marker(str(elsewhere), {"step": 4, "world_size": 1, "files": {}})
    for resume, fix in (("auto", "Drop --resume_from_checkpoint and give --output_dir a new directory."),
                        (str(elsewhere), "Give --output_dir a new or empty directory.")):
        with pytest.raises(ConfigError) as error:
            check_output_dir(Recipe(output_dir=str(output_dir), resume_from_checkpoint=resume))
        assert error.value.messages == [f"{what}. {fix}"]
    with pytest.raises(ConfigError) as error:
        resolve_resume("auto", str(output_dir), 1)
    assert error.value.messages == [f"--resume_from_checkpoint auto found nothing to resume: {what}. Drop "
                                    "--resume_from_checkpoint and give --output_dir a new directory."]
    with pytest.raises(ConfigError, match=r"checkpoint-500' is not a shardtune checkpoint \(no checkpoint_complete"
                                          r".json, and no .shardtune-lock in .*'\): another trainer's checkpoint "
                                          r"cannot be resumed\. Start a new run in a new --output_dir"):
        resolve_resume(str(output_dir / "checkpoint-500"), str(output_dir), 1)
    with pytest.raises(ConfigError, match=r"out' is not a checkpoint, and holds checkpoint-1000, checkpoint-500 with "
                                          r"no checkpoint_complete.json .*: another trainer's checkpoints"):
        resolve_resume(str(output_dir), str(output_dir), 1)
    assert not holds_a_run(str(output_dir))
    assert strangers(str(output_dir)) == ["checkpoint-1000", "checkpoint-500"]
    assert clear_output_dir(str(output_dir)) == ["checkpoint-1000", "checkpoint-500"]
    assert tree(output_dir) == before


def test_unmarked_checkpoints_beside_the_runs_lock_are_its_own(tmp_path):
    """The same folders where a shardtune run took the lock (it does before writing anything, and never removes
    it): saves of that run that did not finish, cleared."""
    output_dir = tmp_path / "out"
    write_files(output_dir, {**TRAINER_FILES, LOCK_FILE: "", ".checkpoint-1500.tmp/model.safetensors": "w"})
    check_output_dir(Recipe(output_dir=str(output_dir), overwrite_output_dir=True))
    assert clear_output_dir(str(output_dir)) == []
    assert os.listdir(output_dir) == [LOCK_FILE]


WANDB_RUN = "wandb/offline-run-20261207_181309-abcd1234"
RUN_FOLDERS = {  # what a run (W&B, the DPO reference cache, save_pretrained) writes in each of its folders
    f"{WANDB_RUN}/run-abcd1234.wandb": "w", f"{WANDB_RUN}/files/config.yaml": "c", f"{WANDB_RUN}/logs/debug.log": "l",
    "wandb/run-20261207_181500-abcd1234-1/files/output.log": "o",
    "reference_log_probs/train.pt": "t", "reference_log_probs/train.json": "{}", "reference_log_probs/eval.json": "{}",
    "reference_log_probs/eval.pt.tmp": "t", "additional_chat_templates/tool_use.jinja": "{{ x }}",
}


def write_run_folders(output_dir) -> None:
    write_files(output_dir, {**RUN_FOLDERS, LOCK_FILE: ""})
    for link, target in (("latest-run", WANDB_RUN.split("/")[1]), ("debug.log", f"{WANDB_RUN.split('/')[1]}/logs/"
                                                                                   "debug.log")):
        (output_dir / "wandb" / link).symlink_to(target)


@pytest.mark.parametrize("stranger", ["wandb/my_thesis.tex", "reference_log_probs/notes.txt",
                                      "additional_chat_templates/notes.txt", "wandb/.env", "wandb/settings"])
def test_a_strangers_file_in_a_run_folder_keeps_the_folder(stranger, tmp_path):
    """The run's folders went whole, whatever was in them: a file no run writes there is refused, named, and kept
    with its folder."""
    output_dir = tmp_path / "out"
    write_run_folders(output_dir)
    (output_dir / stranger).write_text("mine")
    before = tree(output_dir)
    with pytest.raises(ConfigError) as error:
        check_output_dir(Recipe(output_dir=str(output_dir), overwrite_output_dir=True))
    assert error.value.messages == [f"--overwrite_output_dir true deletes only what a run writes, and --output_dir "
                                    f"'{output_dir}' also holds 1 entry no run wrote ({stranger}): move them out, or "
                                    "give --output_dir a directory of the run's own."]
    folder = stranger.split("/")[0]
    assert clear_output_dir(str(output_dir)) == [folder]
    assert {name: content for name, content in tree(output_dir).items() if name.startswith(folder)} == \
        {name: content for name, content in before.items() if name.startswith(folder)}


def test_the_runs_own_contents_of_each_run_folder_are_cleared(tmp_path):
    output_dir = tmp_path / "out"
    write_run_folders(output_dir)
    assert strangers(str(output_dir)) == []
    check_output_dir(Recipe(output_dir=str(output_dir), overwrite_output_dir=True))
    assert clear_output_dir(str(output_dir)) == []
    assert os.listdir(output_dir) == [LOCK_FILE]

"""Real runs of the tiny recipe on a mixture of ShareGPT, `messages` and Alpaca data: the same conversations in
either chat form train to the same losses and gradient norms."""

from __future__ import annotations

from tests.conftest import grad_norms, start_recipe, train_losses
from tests.unit.data.test_formats import alpaca_rows, write_jsonl, write_sharegpt_and_messages


def test_sharegpt_and_messages_train_to_identical_losses_in_a_mixture(tmp_path, tiny_assets):
    """Real runs of the tiny recipe (one process each) on a mixture: the same conversations as ShareGPT or as
    `messages`, with half of an Alpaca file. Both list their sources at start-up and give the same loss and
    gradient norm at every step."""
    sharegpt, messages = write_sharegpt_and_messages(tmp_path)
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(40))
    args = ("--dataset_weights", "1.0,0.5", "--max_seq_length", "128", "--max_steps", "3",
            "--per_device_train_batch_size", "8", "--global_batch_size", "16", "--save_steps", "0",
            "--save_model", "false")
    runs = {name: start_recipe(tmp_path / name, tiny_assets, "--dataset", f"{data},{alpaca}", *args)
            for name, data in (("sharegpt", sharegpt), ("messages", messages))}  # side by side: one core each
    curves = {}
    for name, process in runs.items():
        assert process.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        log = (tmp_path / f"{name}.log").read_text()
        assert f"64 of 64 rows ({name})" in log and "20 of 40 rows (alpaca)" in log
        curves[name] = (train_losses(tmp_path / name), grad_norms(tmp_path / name))
    assert len(curves["sharegpt"][0]) == 3 and all(loss > 0 for loss in curves["sharegpt"][0])
    assert curves["sharegpt"] == curves["messages"]

"""TRL's SFTTrainer on one JSON Lines file, run as its own process by tests/launch/test_peer_trl.py, so that trl (and
the accelerate state its Trainer creates) never enters the test process. Writes, as JSON: the rows of SFTTrainer's
prepared train_dataset (input_ids, labels) in their order, and the trainer's log history.

    python tests/launch/trl_peer.py SETTINGS_JSON OUTPUT_JSON

SETTINGS_JSON holds model_dir, data_file, output_dir, chat_template (or null: the tokenizer's own) and `args`,
the SFTConfig values."""

from __future__ import annotations

import json
import sys

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main(settings_path: str, output_path: str) -> None:
    with open(settings_path, encoding="utf-8") as file:
        settings = json.load(file)
    tokenizer = AutoTokenizer.from_pretrained(settings["model_dir"])
    if settings["chat_template"] is not None:
        tokenizer.chat_template = settings["chat_template"]
    model = AutoModelForCausalLM.from_pretrained(settings["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    trainer = SFTTrainer(
        model=model, processing_class=tokenizer,
        train_dataset=load_dataset("json", data_files=settings["data_file"], split="train"),
        args=SFTConfig(output_dir=settings["output_dir"], **settings["args"]),
    )
    rows = [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in trainer.train_dataset]
    trainer.train()
    with open(output_path, "w", encoding="utf-8") as file:
        json.dump({"rows": rows, "log_history": trainer.state.log_history}, file)


if __name__ == "__main__":
    main(*sys.argv[1:])

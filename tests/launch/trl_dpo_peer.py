"""TRL's DPOTrainer on one JSON Lines file of preference pairs, run as its own process by
tests/launch/test_peer_trl_dpo.py, so that trl (and the accelerate state its Trainer creates) never enters the test
process. Writes, as JSON: the rows of DPOTrainer's prepared train_dataset (prompt_ids, chosen_ids, rejected_ids)
in their order, and the trainer's log history.

    python tests/launch/trl_dpo_peer.py SETTINGS_JSON OUTPUT_JSON

SETTINGS_JSON holds model_dir, data_file, output_dir and `args`, the DPOConfig values. The reference is TRL's own:
a second copy of the model, loaded from the same directory."""

from __future__ import annotations

import json
import sys

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer


def main(settings_path: str, output_path: str) -> None:
    with open(settings_path, encoding="utf-8") as file:
        settings = json.load(file)
    tokenizer = AutoTokenizer.from_pretrained(settings["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(settings["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    trainer = DPOTrainer(
        model=model, processing_class=tokenizer,
        train_dataset=load_dataset("json", data_files=settings["data_file"], split="train"),
        args=DPOConfig(output_dir=settings["output_dir"], **settings["args"]),
    )
    rows = [{key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in trainer.train_dataset]
    trainer.train()
    with open(output_path, "w", encoding="utf-8") as file:
        json.dump({"rows": rows, "log_history": trainer.state.log_history}, file)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Tiny Llama (2 layers, 64 hidden) learning to reverse letter strings: the CPU demo and the tests' recipe.

Launch (CPU, 2 processes, about a minute):
    accelerate launch --config_file accelerate_configs/ds_zero3.yaml --num_processes 2 recipes/tiny.py --use_cpu true
Hardware: any machine; tested on 2 CPU cores. The model and data are made once, under the repository's assets/tiny
(wherever the recipe is launched from).

Align the trained demo model with DPO on the bundled preference pairs (the reversed word chosen over a wrong one):
    accelerate launch --config_file accelerate_configs/ds_zero3.yaml --num_processes 2 recipes/tiny.py --use_cpu true \
        --method dpo --model_name_or_path outputs/tiny
"""

from dataclasses import replace
from pathlib import Path

from shardtune import Recipe, main
from shardtune.models.tiny_assets import ensure_tiny_assets, ensure_tiny_preferences

ASSETS = str(Path(__file__).resolve().parents[1] / "assets" / "tiny")
MODEL_DIR, DATA_FILE = ensure_tiny_assets(ASSETS)

RECIPE = Recipe(
    name="tiny",
    model_name_or_path=MODEL_DIR,
    dataset=DATA_FILE,
    eval_fraction=0.05,
    max_seq_length=64,
    per_device_train_batch_size=16,
    global_batch_size=32,
    learning_rate=3e-3,
    weight_decay=0.0,
    warmup_ratio=0.05,
    max_steps=600,
    gradient_checkpointing=False,
    mixed_precision="no",
    logging_steps=50,
    eval_steps=200,
    save_steps=0,
    report_to="none",
)

# --method dpo: the pairs, and TRL's DPO settings scaled to the tiny model (beta 0.1, sigmoid loss).
DPO_RECIPE = replace(RECIPE, name="tiny_dpo", method="dpo", dataset=ensure_tiny_preferences(ASSETS),
                     learning_rate=1e-4, max_steps=60, warmup_ratio=0.1, logging_steps=10, eval_steps=0)

if __name__ == "__main__":
    main(RECIPE, methods={"dpo": DPO_RECIPE})

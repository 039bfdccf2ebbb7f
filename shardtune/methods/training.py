"""A DPO run's pieces, built once the policy is prepared: the step (shardtune.methods.dpo), the reference it reads
(shardtune.methods.reference), and the precomputation of the reference's log-probs before the first step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from datasets import Dataset

from shardtune.config import LOSS_TILE_POSITIONS, Recipe
from shardtune.methods.dpo import DPOStep
from shardtune.methods.dpo_loss import DPOSettings
from shardtune.methods.pair_batches import PreferenceCollator
from shardtune.methods.reference import (
    describe_reference,
    load_reference,
    precomputed_table,
    reference_log_probs,
)
from shardtune.profiling import phase


@dataclass
class DPOTraining:
    step: DPOStep
    model: torch.nn.Module  # the prepared policy
    splits: dict[str, tuple[Dataset, PreferenceCollator, int]]  # name: (pairs, their collator, batch size)
    mode: str  # shardtune.config.REFERENCE_MODES
    description: str  # the method in the start-up line

    @classmethod
    def build(cls, accelerator: Accelerator, recipe: Recipe, model: torch.nn.Module,
              splits: dict[str, tuple[Dataset, PreferenceCollator, int]]) -> DPOTraining:
        settings, mode = DPOSettings.of(recipe), recipe.reference_mode
        tile = LOSS_TILE_POSITIONS if recipe.chunked_cross_entropy else None
        # Precomputed, the log-probs come from --ref_model_name_or_path (held only while they are computed), else
        # under LoRA from the base with the adapter off, else from the policy as loaded.
        named = mode == "precomputed" and bool(recipe.ref_model_name_or_path)
        reference = load_reference(accelerator, recipe) if mode == "live" or named else None
        of_reference = reference_log_probs(accelerator, recipe, model, reference, tile) \
            if mode != "precomputed" or recipe.use_peft or named else None
        step = DPOStep(settings, None if mode == "precomputed" else of_reference, tile, precompute_with=of_reference)
        losses = " + ".join(f"{weight:g} {name}" if len(settings.loss_types) > 1 else name
                            for name, weight in zip(settings.loss_types, settings.loss_weights, strict=True))
        description = f"dpo ({losses}, beta {settings.beta:g}; {describe_reference(recipe)})"
        return cls(step, model, splits, mode, description)

    def precompute(self, accelerator: Accelerator, recipe: Recipe) -> None:
        """The reference log-probs of every pair, where they are precomputed: read from the output dir's cache, or
        computed in one pass and cached; each split's collator then hands them out with its batches."""
        if self.mode != "precomputed":
            return
        for name, (dataset, collate, batch_size) in self.splits.items():
            started = time.perf_counter()
            with phase("reference_precompute"):
                table, read = precomputed_table(accelerator, recipe, self.model, dataset, name, collate, batch_size,
                                                self.step.precompute_with, self.step.tile)
            collate.reference = table
            accelerator.print(f"shardtune: reference log-probs of {len(dataset)} {name} pairs "
                              f"{'read from the cache' if read else 'computed'} in "
                              f"{time.perf_counter() - started:.1f}s")
        self.step.precompute_with = None  # a reference model loaded for the pass is freed with it

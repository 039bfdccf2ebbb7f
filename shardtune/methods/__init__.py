"""Training methods beyond supervised fine-tuning: what a batch's loss is, what the data and the reference give it.

`dpo` (direct preference optimisation, TRL's DPOTrainer): preference pairs (`preference`), the reference model's
log-probs (`reference`), the pairwise loss family (`dpo_loss`) and the micro-batch step and eval (`dpo`). SFT's loss
is the trainer's own (shardtune.step, shardtune.levers.tiled_loss). A reference-free method (SimPO, ORPO) is one
more loss over the same sequence log-probs, without a reference.
"""

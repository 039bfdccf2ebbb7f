"""Unit tests of checkpoints (shardtune/checkpoint/): durability, deletions, the output dir, resume on other sizes."""

"""Unit tests of the levers (shardtune/levers/): compile, float8, Liger, optimizers, tiled loss."""

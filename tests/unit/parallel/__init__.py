"""Unit tests of the launch and its axes (shardtune/parallel/): ranks, DeepSpeed ops, sequence, context, tensor."""

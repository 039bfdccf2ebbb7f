"""Parallel axes beyond data parallelism: the sequence split (DeepSpeed Ulysses, shardtune.parallel.sequence) and
tensor parallelism (transformers' plan over accelerate's tp axis, shardtune.parallel.tensor)."""

"""Parallel axes beyond data parallelism: the sequence split (DeepSpeed Ulysses, shardtune.parallel.sequence)."""

"""Unit tests of make gpu-check's helpers (shardtune/gpu_check/), its wheels and its rehearsal."""

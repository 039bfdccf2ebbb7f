"""Unit tests of the families (shardtune/models/): shapes, parameter counts, FLOPs."""

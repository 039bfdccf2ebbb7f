"""Unit tests of the methods (shardtune/methods/): DPO's checks and preference batches."""

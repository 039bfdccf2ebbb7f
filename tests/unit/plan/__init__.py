"""Unit tests of the planner (shardtune/plan/): phases, accuracy, flags, host memory, DPO, tensor parallelism."""

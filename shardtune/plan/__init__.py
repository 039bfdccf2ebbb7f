"""The memory planner: per-GPU and host memory of any model x hardware x accelerate config before a weight is
loaded, and the fastest config that fits (`python -m shardtune.plan`). strategy reads the accelerate configs;
states, activations, buffers, host and phases size a run's parts; planner sums them into a MemoryPlan; search
finds the fastest that fits; report prints and charts; launched plans a launched recipe."""

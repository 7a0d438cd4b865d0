"""Tensor parallelism (issue 41): each rank holds a shard of every attention and MLP block.

`shard.py` decides what a rank holds (its heads, its MLP columns, its slice of each checkpoint
tensor) and where the all-reduces go; `ranks.py` starts and drives the other ranks' worker
processes, which receive each step's typed `RunPlan` from rank 0 (the engine's process) and run
their shard of the forward. Scheduling, sampling and the KV bookkeeping stay on rank 0.
"""

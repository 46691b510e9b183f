"""Tensor parallelism's plumbing: the engine's model split over rank processes.

- executor.py     `TPExecutor`: spawns the rank processes and runs each step on all of them
                  (TP rank 0 samples): the model runner's stand-in at TP > 1
- channel.py      `StepChannel`: the per-step broadcast to the ranks and gather of their replies
- cpu_bind.py     which CPUs each rank computes on (`--cpu-bind`)

How heads split over ranks is a fact the KV transfer code needs too: shape/tp_split.py.
"""

"""Tensor parallelism: the model's collectives (group.py) and the processes that run its shards."""

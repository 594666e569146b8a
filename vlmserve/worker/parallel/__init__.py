"""Tensor parallelism: Megatron-style sharding of the decoder over ranks, one process per
rank (`executor.py` starts them, `worker.py` is their loop, `comm.py` their collectives)."""

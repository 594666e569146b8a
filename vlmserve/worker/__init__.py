"""The device side: the model runner, models, CUDA graphs, nano-batching, tensor parallelism."""

"""Benchmarks of the whole engine offline: throughput, async scheduling, nano-batching and
its schedule search, speculation, the encoder cache, captioning."""

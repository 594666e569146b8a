"""Benchmarks of the served engine: load tests, admission, the simulator against the real
server, vLLM side by side."""

"""Traces, the trace simulator (the real scheduler on the cost model's clock), capacity."""

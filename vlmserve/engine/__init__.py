"""The engine loop: requests in, steps, outputs out (stop, fault isolation, async)."""

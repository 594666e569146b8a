"""Sampling: parameters, batched ops over [rows, vocab], the step sampler, draft verification."""

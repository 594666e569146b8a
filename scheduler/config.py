"""Configs of the CPU-side policy: the KV cache geometry and the step planner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: the runner sizes the pool from `memory_bytes` (CPU) or free device memory.
    num_blocks: int | None = None
    memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    # Admission keeps this fraction of the pool free for running sequences to grow into.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark} must be in [0, 1)")


@dataclass(frozen=True)
class SchedulerConfig:
    # The dense token budget of one step (B_dense, NanoFlow §4.2): decodes first, then
    # prefill chunks fill the rest.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")

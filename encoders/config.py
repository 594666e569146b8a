"""EncoderConfig: the vision side's serving settings (preprocessing pool, encoder cache)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def default_num_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class EncoderConfig:
    # Preprocessing pool: worker processes (0 = decode in the calling thread; None = one
    # per core) and the bound on images queued or in flight (backpressure past it).
    num_workers: int | None = None
    max_pending: int = 64
    submit_timeout_s: float = 30.0
    max_pixels: int = 64_000_000  # decompression-bomb cap, checked from the header
    # Pixels being decoded at once, process-wide (`encoders.pixel_budget`); an image waits
    # up to `submit_timeout_s` for room, then gets a retryable 503. None: 2 x max_pixels.
    max_decode_pixels: int | None = None
    # JPEG draft decoding (1/2..1/8 scale when every resample target is that small) is
    # opt-in: it changed 16-token greedy outputs on 32% of requests for Idefics3, 12% for
    # LLaVA-OneVision, 5% for the embedded model vs 0% with it off
    # (benchmarks/engine/jpeg_draft_divergence.py, 100 JPEGs per family). Off: exact pixels.
    jpeg_draft: bool = False
    # Encoder-output cache (pooled embeddings on the runner's device); 0 turns it off.
    cache_bytes: int = 256 << 20
    # False: keep the checkpoint's HF image processor on the serving path.
    use_pool: bool = True
    # Gemma 3: also feed elongated images as 2-4 crops, each one more image's tokens
    # (transformers' `do_pan_and_scan`, off by default as in its processor).
    pan_and_scan: bool = False

    def __post_init__(self) -> None:
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers} must be >= 0 (or None)")
        if self.max_pending < 1:
            raise ValueError(f"max_pending={self.max_pending} must be >= 1")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels={self.max_pixels} must be >= 1")
        if self.max_decode_pixels is not None and self.max_decode_pixels < self.max_pixels:
            raise ValueError(
                f"max_decode_pixels={self.max_decode_pixels} must be >= max_pixels="
                f"{self.max_pixels} (or one image under the cap could never decode)"
            )
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes={self.cache_bytes} must be >= 0")

    @property
    def resolved_num_workers(self) -> int:
        return default_num_workers() if self.num_workers is None else self.num_workers

    @property
    def resolved_max_decode_pixels(self) -> int:
        return 2 * self.max_pixels if self.max_decode_pixels is None else self.max_decode_pixels

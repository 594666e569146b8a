"""glibc malloc tuning, in one place, for processes whose large buffers come and go (the
engine's CPU activations, a preprocessing worker's decoded images).

By default glibc serves each allocation over its mmap threshold (dynamic, 128 KiB up to
32 MiB) with fresh zeroed pages from the kernel and unmaps them on free, so a buffer
allocated again every step or image costs page faults and page zeroing each time.
Raising the mmap and trim thresholds keeps such buffers in the heap for reuse, as
tcmalloc (which vLLM's CPU build preloads) does.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
# Older glibc refuses an mmap threshold over HEAP_MAX_SIZE / 2, 32 MiB on 64-bit (mallopt
# returns 0 and changes nothing); glibc 2.36 accepts and honours more. 32 MiB is the
# largest every glibc accepts.
PORTABLE_MMAP_THRESHOLD = 32 << 20


def keep_freed_memory(mmap_threshold: int, trim_threshold: int) -> int | None:
    """Serve allocations up to `mmap_threshold` bytes from the heap and keep up to
    `trim_threshold` bytes of freed heap instead of returning it. A threshold this glibc
    refuses falls back to PORTABLE_MMAP_THRESHOLD. Process-wide; the process keeps its
    peak heap. Returns the mmap threshold set; None where the C library is not glibc (or
    refused both)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here: large buffers use the default allocator")
        return None
    threshold = mmap_threshold
    if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        threshold = min(mmap_threshold, PORTABLE_MMAP_THRESHOLD)
        if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
            return None
    return threshold if mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 else None

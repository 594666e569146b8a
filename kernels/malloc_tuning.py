"""Host memory tuning, in one place: glibc malloc for processes whose large buffers come
and go (the engine's CPU activations, a preprocessing worker's decoded images), and huge
pages for the large buffers that stay (the KV cache, a GGUF file's blocks: `huge_page_area`).
Torch-free: the preprocessing workers import it and never load torch.

By default glibc serves each allocation over its mmap threshold (dynamic, 128 KiB up to
32 MiB) with fresh zeroed pages from the kernel and unmaps them on free, so a buffer
allocated again every step or image costs page faults and page zeroing each time.
Raising the mmap and trim thresholds keeps such buffers in the heap for reuse, as
tcmalloc (which vLLM's CPU build preloads) does.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

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


def huge_page_area(nbytes: int) -> mmap.mmap | None:
    """`nbytes` of fresh zeroed memory on a mapping of its own that Linux is asked to back
    with transparent huge pages (2 MiB; granted where /sys/kernel/mm/transparent_hugepage/
    enabled says "madvise", a common default, or "always"); None under 4 MiB or where mmap
    cannot advise. The paged KV cache is read a 16-token block at a time at scattered
    places: on 4 KiB pages nearly every block costs TLB misses. Its own mapping, not
    malloc's: memory malloc hands out again was written on small pages already, where the
    advice would come too late. Where the advice is refused (no THP, another OS) the
    memory is the same, on small pages; it is unmapped with the last object holding it."""
    if nbytes < 4 << 20 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    # anonymous and private (the default, shared, would be shmem: THP by another setting)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        log.info("no transparent huge pages here: large buffers stay on small pages")
    return area


def thp_mode() -> str:
    """Transparent huge pages' setting ("always [madvise] never": the bracketed one holds;
    "absent" where the kernel has none)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "absent"

"""The host memory helpers: a buffer under the threshold keep_freed_memory sets comes from
the heap, where glibc's default maps it afresh (each in a fresh process, read by
mallinfo2); a KV cache advised onto huge pages is on them (read from /proc/self/smaps)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels.malloc_tuning import huge_page_area, thp_mode
from tests.helpers import huge_page_bytes
from vlmserve.worker.kv_groups import allocate_kv_caches, kv_layout

# Prints the bytes glibc holds in mmapped chunks while a 24 MiB buffer is live.
PROBE = """
import ctypes, sys
from kernels.malloc_tuning import PORTABLE_MMAP_THRESHOLD, keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    print("skip")
    sys.exit()
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
if sys.argv[1] == "tuned":
    assert keep_freed_memory(PORTABLE_MMAP_THRESHOLD, 256 << 20) == PORTABLE_MMAP_THRESHOLD
buffer = libc.malloc(24 << 20)
print(libc.mallinfo2().hblkhd)
"""


def _mmapped_bytes(mode: str) -> int | None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    ).stdout.strip()
    return None if out == "skip" else int(out)


def test_a_buffer_under_the_threshold_comes_from_the_heap() -> None:
    default = _mmapped_bytes("default")
    if default is None:
        pytest.skip("not glibc >= 2.33 (no mallinfo2)")
    assert default >= 24 << 20  # glibc's default: mapped afresh, unmapped on free
    assert _mmapped_bytes("tuned") < 24 << 20  # from the heap (other chunks may be mapped)


def test_the_kv_cache_is_on_huge_pages_where_linux_grants_them() -> None:
    if "[madvise]" not in (mode := thp_mode()):  # "always": on them unasked; "never": none
        pytest.skip(f"transparent huge pages are {mode!r}, not on request")
    shape = (2, 1, 16 << 10, 256)  # 16 MiB of bfloat16 a layer
    caches = allocate_kv_caches(kv_layout((), 2), shape, torch.bfloat16, torch.device("cpu"))
    assert all(huge_page_bytes(c) >= 8 << 20 for c in caches)  # most of each (alignment)
    assert all(c.count_nonzero() == 0 for c in caches)
    assert huge_page_area(1 << 20) is None  # small buffers: malloc's


def test_the_preprocessing_worker_still_loads_no_torch() -> None:
    """The memory helpers stay torch-free: the preprocessing workers import them, and a
    worker that imported torch would pay its start-up and memory in every process."""
    probe = "import sys, encoders.preprocess_worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

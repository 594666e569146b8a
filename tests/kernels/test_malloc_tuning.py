"""The one glibc malloc tuning helper: a buffer under the threshold it sets comes from the
heap, where glibc's default maps it afresh (each in a fresh process, read by mallinfo2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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

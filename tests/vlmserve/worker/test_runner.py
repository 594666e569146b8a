"""The runner's process-level CPU settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


# Run in a fresh process: page faults are counted for the whole process, and threads that
# earlier tests left (servers, pools, forward threads) fault too.
_FAULTS = """
import resource, sys, torch
from vlmserve.worker.runner import keep_activations_in_heap

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

mib = int(sys.argv[1])
size = (mib << 20) // 4
threshold = keep_activations_in_heap()
if threshold is None or threshold < (mib + 1) << 20:
    print(f"skip {threshold}")
    sys.exit(0)
for _ in range(2):  # the heap grows to hold it
    torch.empty(size).fill_(1.0)
before = faults()
for _ in range(10):
    torch.empty(size).fill_(1.0)
print(faults() - before)
"""


# 40 MiB: an activation past glibc's default mmap threshold; 64 MiB: a decode step's float32
# logits at 64 sequences and a 262,144-token vocabulary (Gemma 3), allocated every step.
@pytest.mark.parametrize("mib", [40, 64])
def test_freed_activations_are_reused_without_page_faults(mib: int) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, str(mib)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout.split()  # fmt: skip
    if out[0] == "skip":
        pytest.skip(f"glibc mallopt unavailable or capped here (threshold {out[1]})")
    # Default glibc: every round maps fresh pages, 10 x 256 faults a MiB. Kept in the heap:
    # none, or one round's while the heap's top settles (0 or 256 a MiB in a fresh process).
    assert int(out[-1]) < 2 * 256 * mib

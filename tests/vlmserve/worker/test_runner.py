"""The runner's process-level CPU settings."""

from __future__ import annotations

import resource

import pytest
import torch

from vlmserve.worker.runner import keep_activations_in_heap


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_freed_activations_are_reused_without_page_faults() -> None:
    size = (40 << 20) // 4  # a 40 MiB activation, past glibc's default mmap threshold
    threshold = keep_activations_in_heap()
    if threshold is None or threshold < 40 << 20:
        pytest.skip(f"glibc mallopt unavailable or capped here (threshold {threshold})")
    for _ in range(2):  # the heap grows to hold it
        torch.empty(size).fill_(1.0)
    before = _minor_faults()
    for _ in range(10):
        torch.empty(size).fill_(1.0)
    # Default glibc: every round maps fresh pages, 10 x 10,240 faults.
    assert _minor_faults() - before < 2_000

"""Admission policy: which waiting sequence may start, given the free KV blocks.

The basic policy is first-come first-served with a watermark: a sequence is admitted when
the blocks its whole prompt still needs (after prefix-cache hits), plus what already
admitted prompts still need, leave the watermark free. Reserving the whole prompt up
front keeps chunked prefills from admitting more work than fits and then thrashing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from scheduler.sequence import Sequence


class AdmissionPolicy(Protocol):
    def candidates(self, waiting: Iterable[Sequence]) -> Iterable[Sequence]:
        """Waiting sequences in the order they should be considered."""
        ...

    def can_admit(self, seq: Sequence, blocks_needed: int, blocks_available: int) -> bool:
        """Whether `seq` may start; `blocks_available` already excludes reservations."""
        ...


class FcfsAdmission:
    """Arrival order; stops at the first sequence that does not fit (no overtaking, so a
    large image prompt is never starved by a stream of small ones)."""

    def __init__(self, num_blocks: int, watermark: float) -> None:
        self.watermark_blocks = int(num_blocks * watermark)

    def candidates(self, waiting: Iterable[Sequence]) -> Iterable[Sequence]:
        return waiting

    def can_admit(self, seq: Sequence, blocks_needed: int, blocks_available: int) -> bool:
        return blocks_available - blocks_needed >= self.watermark_blocks

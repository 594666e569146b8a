"""PixelBudget: a process-wide bound on the pixels being decoded at once.

The per-image cap (`EncoderConfig.max_pixels`) bounds one decode; this bounds their sum,
so a burst of large images waits (then gets a retryable 503) instead of taking the
process's memory up by the decoded size of every image in flight. Each decode reserves
its image's pixel count for as long as its pixels are alive: `load_image` / `open_rgb`
for the decode (and the caller's tiling), the preprocessing pool from submit until the
image's result or error arrives.

Invariant: `in_use` is the sum of the reservations not yet released, 0 <= in_use <=
total_pixels. Waiters are served in arrival order, so a big image is not starved by a
stream of small ones.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from encoders.errors import ImageBusyError, ImageTooLargeError

__all__ = ["DEFAULT_BUDGET_TIMEOUT_S", "PixelBudget", "shared_budget"]

DEFAULT_BUDGET_TIMEOUT_S = 30.0


class PixelBudget:
    """A weighted semaphore over pixels (FIFO). `reserve(n, timeout)` holds n pixels."""

    def __init__(self, total_pixels: int) -> None:
        if total_pixels < 1:
            raise ValueError(f"total_pixels={total_pixels} must be >= 1")
        self.total_pixels = total_pixels
        self.in_use = 0
        self.max_in_use = 0  # high-water mark (tests, metrics)
        self.num_timeouts = 0
        self._cond = threading.Condition()
        self._waiters: collections.deque[object] = collections.deque()

    def acquire(self, num_pixels: int, timeout: float | None = DEFAULT_BUDGET_TIMEOUT_S) -> None:
        """Take `num_pixels` (blocks up to `timeout` s; None waits as long as it takes).
        Raises ImageTooLargeError (413) at once for more than the whole budget, and
        ImageBusyError (503, retryable) when the wait runs out."""
        if num_pixels > self.total_pixels:
            raise ImageTooLargeError(
                f"image has {num_pixels} pixels, over the whole decode budget of "
                f"{self.total_pixels} pixels"
            )
        if num_pixels <= 0:
            return
        ticket = object()
        with self._cond:
            self._waiters.append(ticket)
            try:
                granted = self._cond.wait_for(
                    lambda: (
                        self._waiters[0] is ticket and self.in_use + num_pixels <= self.total_pixels
                    ),
                    timeout,
                )
                if not granted:
                    self.num_timeouts += 1
                    raise ImageBusyError(
                        f"image decoding is saturated ({self.in_use} of {self.total_pixels} "
                        f"pixels in use for {timeout:g} s); retry later"
                    )
                self.in_use += num_pixels
                self.max_in_use = max(self.max_in_use, self.in_use)
            finally:
                self._waiters.remove(ticket)
                self._cond.notify_all()  # the next in line may fit now

    def release(self, num_pixels: int) -> None:
        if num_pixels <= 0:
            return
        with self._cond:
            assert num_pixels <= self.in_use, f"release of {num_pixels} > {self.in_use} in use"
            self.in_use -= num_pixels
            self._cond.notify_all()

    @contextlib.contextmanager
    def reserve(
        self, num_pixels: int, timeout: float | None = DEFAULT_BUDGET_TIMEOUT_S
    ) -> Iterator[None]:
        """`acquire` for the duration of the `with` block."""
        self.acquire(num_pixels, timeout)
        try:
            yield
        finally:
            self.release(num_pixels)

    def check_integrity(self) -> None:
        with self._cond:
            assert 0 <= self.in_use <= self.total_pixels, (self.in_use, self.total_pixels)


_SHARED: dict[int, PixelBudget] = {}
_SHARED_LOCK = threading.Lock()


def shared_budget(total_pixels: int) -> PixelBudget:
    """The process's budget of that size: every engine, pool and `load_image` call
    configured with the same `max_decode_pixels` shares one."""
    with _SHARED_LOCK:
        if total_pixels not in _SHARED:
            _SHARED[total_pixels] = PixelBudget(total_pixels)
        return _SHARED[total_pixels]

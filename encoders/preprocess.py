"""The CPU preprocessing pool: worker processes that turn encoded image bytes into uint8
tiles, fed through a bounded queue.

  * `num_workers` processes (forked from a forkserver, never from the threaded parent), each
    driven by one feeder thread in the parent that hands it one image at a time. A
    worker that dies (a decoder segfault, an OOM or operator kill) is replaced and the
    image it held is retried once on the replacement; a second death fails only that
    image, with a retryable 503 (`WorkerCrashedError`), never a 400 that blames it.
  * With a `PixelBudget`, `submit` reserves the image's pixels (from its header) until
    its result or error arrives, so the decodes in flight stay under a memory bound.
  * At most `max_pending` images are queued or in flight: `submit` blocks (then raises
    `PreprocessBusyError`) past that, so a burst applies backpressure instead of memory.
  * Tiles cross processes as uint8 in shared memory (4x smaller than float32), written
    there directly by the resize/tile step; the runner normalises them on its device
    (`encoders.stage`).
  * Per image: queue, decode, resize/tile and hand-off seconds, wall clock and CPU
    (`StageTimings`), summed in `metrics()`.
With `num_workers=0` the same work runs in the calling thread (tests, tiny deployments).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, fields
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import numpy as np

from encoders.errors import RequestError, RetryableError
from encoders.image_io import DEFAULT_MAX_PIXELS, preprocess_bytes, read_header
from encoders.pixel_budget import PixelBudget, shared_budget
from encoders.preprocess_worker import _to_tensor, _unexpected, _Worker

if TYPE_CHECKING:
    import torch

__all__ = [
    "PreprocessBusyError", "PreprocessPool", "StageTimings", "TileResult", "WorkerCrashedError",
    "shared_pool",
]  # fmt: skip


class WorkerCrashedError(RetryableError):
    """The worker died on this image twice (its first death may have been an OOM or
    operator kill, so the image is not blamed: 503, retry later)."""


class PreprocessBusyError(RetryableError):
    """The pool stayed full for the whole submit timeout."""

    status = 503


@dataclass(frozen=True)
class StageTimings:
    """Seconds per stage of one image: waiting for a worker, reading the bytes (set by
    the caller), decoding, resizing/tiling, and handing the tiles to the parent; then the
    CPU seconds of the last three (the worker's and the feeder thread's own time)."""

    queue_s: float = 0.0
    read_s: float = 0.0  # passed to `submit(read_s=...)` by the caller that read the bytes
    decode_s: float = 0.0
    resize_s: float = 0.0
    handoff_s: float = 0.0
    decode_cpu_s: float = 0.0
    resize_cpu_s: float = 0.0
    handoff_cpu_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Wall seconds from submit to tiles in the parent."""
        return self.queue_s + self.read_s + self.decode_s + self.resize_s + self.handoff_s


@dataclass(frozen=True)
class TileResult:
    tiles: torch.Tensor  # [num_tiles, S, S, 3] uint8, CPU (pinned when CUDA is up)
    timings: StageTimings


class PreprocessPool:
    """`submit(data, spec, multi_image, max_pixels)` -> Future[TileResult]. A worker
    calls `process_fn(*args, alloc=...)` (inline: `process_fn(*args)`), which returns a
    `Preprocessed` whose tiles are best written into `alloc(shape)`. With a `budget`,
    each image holds its pixels on it from submit to result."""

    max_attempts = 2  # a worker death retries the image once on the replacement

    def __init__(
        self,
        num_workers: int,
        max_pending: int = 64,
        process_fn: Callable = preprocess_bytes,
        start_method: str = "forkserver",
        budget: PixelBudget | None = None,
    ) -> None:
        if num_workers < 0 or max_pending < 1:
            raise ValueError(f"need num_workers >= 0 and max_pending >= 1, got "
                             f"{num_workers}, {max_pending}")  # fmt: skip
        self.num_workers, self.max_pending = num_workers, max_pending
        self.process_fn, self.budget = process_fn, budget
        self._slots = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._totals = {f.name: 0.0 for f in fields(StageTimings)}
        self.num_done = self.num_errors = self.num_crashes = self.num_retries = 0
        self._closed = False
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Workers fork from a clean single-threaded server that has the decode stack
            # imported once: a replacement worker starts in milliseconds.
            self._ctx.set_forkserver_preload(["encoders.image_io"])
        self._tasks: list = []
        self._cond = threading.Condition(self._lock)
        self.workers = [_Worker(self._ctx, process_fn) for _ in range(num_workers)]
        self._threads = [
            threading.Thread(target=self._feed, args=(i,), daemon=True, name=f"preprocess-{i}")
            for i in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    # -- submission ----------------------------------------------------------------

    def submit(
        self,
        *args: Any,
        timeout: float | None = None,
        num_pixels: int | None = None,
        read_s: float = 0.0,
    ) -> Future:
        """Queue one image; blocks while `max_pending` are queued or running, then (with a
        budget) while its pixels do not fit; `timeout` bounds each wait (None: as long as
        it takes). `num_pixels`: the image's stored pixel count, when the caller has read
        its header (None: read here; a header that does not parse reserves nothing and
        fails in the worker). `read_s`: the seconds the caller spent reading the bytes
        (its `read_s` stage). Raises PreprocessBusyError / ImageBusyError (503),
        ImageTooLargeError (413) for an image over the whole budget."""
        if self._closed:
            raise RuntimeError("the preprocessing pool is closed")
        if not self._slots.acquire(timeout=timeout):  # None: wait as long as it takes
            raise PreprocessBusyError(
                f"image preprocessing is saturated ({self.max_pending} images pending for "
                f"{timeout:.0f} s); retry later"
            )
        try:
            reserved = self._reserve(args, num_pixels, timeout)
        except BaseException:
            self._slots.release()
            raise
        future: Future = Future()
        future.add_done_callback(lambda _: self._release(reserved))
        if not self.workers:
            self._run_inline(future, args, read_s)
            return future
        with self._cond:
            self._tasks.append((future, args, time.perf_counter(), read_s))
            self._cond.notify()
        return future

    def _reserve(self, args: tuple, num_pixels: int | None, timeout: float | None) -> int:
        """Pixels taken on the budget for this image (0 without a budget)."""
        if self.budget is None:
            return 0
        if num_pixels is None:
            max_pixels = args[3] if len(args) > 3 else DEFAULT_MAX_PIXELS
            try:
                header = read_header(args[0], max_pixels)
            except (RequestError, TypeError):  # the worker reports it (or a test's fn)
                return 0
            num_pixels = header.num_pixels
        self.budget.acquire(num_pixels, timeout)
        return num_pixels

    def _release(self, reserved: int) -> None:
        if self.budget is not None:
            self.budget.release(reserved)
        self._slots.release()

    def try_submit(self, *args: Any, num_pixels: int | None = None) -> Future | None:
        """`submit` that returns None instead of waiting when the pool (or budget) is full."""
        try:
            return self.submit(*args, timeout=0, num_pixels=num_pixels)
        except RetryableError:
            return None

    @property
    def num_pending(self) -> int:
        return self.max_pending - self._slots._value  # noqa: SLF001 - a gauge only

    def _run_inline(self, future: Future, args: tuple, read_s: float) -> None:
        future.set_running_or_notify_cancel()
        try:
            result = self.process_fn(*args)
            start, start_cpu = time.perf_counter(), time.thread_time()
            tiles = _to_tensor(np.ascontiguousarray(result.tiles))
            timings = StageTimings(0.0, read_s, result.decode_s, result.resize_s,
                                   time.perf_counter() - start, result.decode_cpu_s,
                                   result.resize_cpu_s, time.thread_time() - start_cpu)  # fmt: skip
            self._finish(future, TileResult(tiles, timings))
        except RequestError as e:
            self._fail(future, e)
        except Exception as e:  # noqa: BLE001 - as in a worker: fails this image only
            self._fail(future, _unexpected(e))

    # -- feeder threads ----------------------------------------------------------------

    def _next_task(self) -> tuple | None:
        with self._cond:
            while not self._tasks and not self._closed:
                self._cond.wait()
            return self._tasks.pop(0) if self._tasks else None

    def _feed(self, index: int) -> None:
        while (task := self._next_task()) is not None:
            future, args, queued_at, read_s = task
            if not future.set_running_or_notify_cancel():
                continue
            queue_s = time.perf_counter() - queued_at
            for attempt in range(1, self.max_attempts + 1):
                worker = self.workers[index]
                message = self._run_on(worker, args)
                if message is not None:
                    break
                code = self._replace(index)
                if self._closed:
                    self._fail(future, WorkerCrashedError(
                        "the preprocessing pool closed while decoding this image; retry"
                    ))  # fmt: skip
                    break
                if attempt == self.max_attempts:
                    self._fail(future, WorkerCrashedError(
                        f"the preprocessing worker died (exit code {code}) on each of "
                        f"{attempt} attempts at this image; retry later"
                    ))  # fmt: skip
                    break
                with self._lock:
                    self.num_retries += 1
            if message is None:
                continue
            if message[0] == "err":
                self._fail(future, message[1])
            else:
                _, name, shape, (decode_s, resize_s, decode_cpu_s, resize_cpu_s), write = message
                start, start_cpu = time.perf_counter(), time.thread_time()
                tiles = worker.take(name, shape)
                handoff_s = write[0] + time.perf_counter() - start
                handoff_cpu_s = write[1] + time.thread_time() - start_cpu
                timings = StageTimings(queue_s, read_s, decode_s, resize_s, handoff_s,
                                       decode_cpu_s, resize_cpu_s, handoff_cpu_s)  # fmt: skip
                self._finish(future, TileResult(tiles, timings))

    @staticmethod
    def _run_on(worker: _Worker, args: tuple) -> tuple | None:
        """Send one image to `worker` and wait for its answer; None if it died."""
        try:
            worker.conn.send(args)
            ready = wait([worker.conn, worker.process.sentinel])
            return worker.conn.recv() if worker.conn in ready else None
        except (EOFError, OSError):
            return None

    def _replace(self, index: int) -> int | None:
        """Reap the dead worker at `index` (its blocks unlinked), start its replacement
        (unless closing); its exit code (negative: the signal that killed it)."""
        worker = self.workers[index]
        worker.process.join(timeout=1)
        code = worker.process.exitcode
        worker.conn.close()
        worker.unmap(unlink=True)
        if not self._closed:  # replace first: whoever sees the failure sees a full pool
            self.workers[index] = _Worker(self._ctx, self.process_fn)
        with self._lock:
            self.num_crashes += 1
        return code

    def _finish(self, future: Future, result: TileResult) -> None:
        with self._lock:
            self.num_done += 1
            for name in self._totals:
                self._totals[name] += getattr(result.timings, name)
        future.set_result(result)

    def _fail(self, future: Future, error: BaseException) -> None:
        with self._lock:
            self.num_errors += 1
        future.set_exception(error)

    # -- metrics and shutdown ------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Counters and per-stage seconds summed over finished images."""
        with self._lock:
            out: dict[str, float] = {f"{k}_total": v for k, v in self._totals.items()}
            out.update(images=self.num_done, errors=self.num_errors, crashes=self.num_crashes,
                       retries=self.num_retries, pending=self.num_pending,
                       workers=self.num_workers)  # fmt: skip
        if self.budget is not None:
            out.update(decode_pixels_in_use=self.budget.in_use,
                       decode_budget_timeouts=self.budget.num_timeouts)  # fmt: skip
        return out

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        for worker in self.workers:
            worker.stop()
        for future, *_ in self._tasks:
            future.cancel()

    def __enter__(self) -> PreprocessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: dict[tuple[int, int, int], PreprocessPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(
    num_workers: int, max_pending: int, max_decode_pixels: int = 2 * DEFAULT_MAX_PIXELS
) -> PreprocessPool:
    """One pool per (size, bound, pixel budget) per process: engines share it (the work
    is stateless, the spec travels with each image), and its budget is the process's
    `shared_budget(max_decode_pixels)`, the one `load_image` uses. Closed at exit."""
    with _SHARED_LOCK:
        key = (num_workers, max_pending, max_decode_pixels)
        if key not in _SHARED:
            if not _SHARED:
                atexit.register(_close_shared)
            budget = shared_budget(max_decode_pixels)
            _SHARED[key] = PreprocessPool(num_workers, max_pending, budget=budget)
        return _SHARED[key]


def _close_shared() -> None:
    for pool in _SHARED.values():
        pool.close()
    _SHARED.clear()

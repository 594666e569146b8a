"""The CPU preprocessing pool: worker processes that turn encoded image bytes into uint8
tiles, fed through a bounded queue.

  * `num_workers` processes (forked from a forkserver, never from the threaded parent), each
    driven by one feeder thread in the parent that hands it one image at a time. A
    worker that dies (a decoder segfault, OOM kill) fails only the image it held and is
    replaced; the pool keeps serving.
  * At most `max_pending` images are queued or in flight: `submit` blocks (then raises
    `PreprocessBusyError`) past that, so a burst applies backpressure instead of memory.
  * Tiles cross processes as uint8 in shared memory (4x smaller than float32); the
    runner normalises them on its device (`encoders.stage`).
  * Per image: queue, decode, resize/tile and hand-off seconds (`StageTimings`), summed
    in `metrics()`.
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
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any

import numpy as np

from encoders.image_io import preprocess_bytes
from vlmserve.errors import ImageDecodeError, RequestError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PreprocessBusyError", "PreprocessPool", "StageTimings", "TileResult", "WorkerCrashedError",
    "shared_pool",
]  # fmt: skip


class WorkerCrashedError(ImageDecodeError):
    """The worker died while decoding this image (the image is the likely cause)."""


class PreprocessBusyError(RequestError):
    """The pool stayed full for the whole submit timeout."""

    status = 503


@dataclass(frozen=True)
class StageTimings:
    """Seconds per stage of one image: waiting for a worker, reading the bytes (set by
    the caller), decoding, resizing/tiling, and handing the tiles to the parent."""

    queue_s: float = 0.0
    read_s: float = 0.0
    decode_s: float = 0.0
    resize_s: float = 0.0
    handoff_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class TileResult:
    tiles: torch.Tensor  # [num_tiles, S, S, 3] uint8, CPU (pinned when CUDA is up)
    timings: StageTimings


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    import torch

    out = torch.empty(array.shape, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    out.numpy()[...] = array
    return out


def _worker_main(conn: Any, process_fn: Callable) -> None:
    """Worker loop: args in, ("ok", shm name, shape, decode_s, resize_s, write_s) or
    ("err", exception) out; None or a closed pipe ends it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        if args is None:
            return
        try:
            result = process_fn(*args)
            start = time.perf_counter()
            tiles = np.ascontiguousarray(result.tiles)
            shm = SharedMemory(create=True, size=max(tiles.nbytes, 1))
            np.ndarray(tiles.shape, np.uint8, buffer=shm.buf)[...] = tiles
            name = shm.name
            shm.close()  # the parent unlinks it once copied
            write_s = time.perf_counter() - start
            conn.send(("ok", name, tiles.shape, result.decode_s, result.resize_s, write_s))
        except RequestError as e:
            conn.send(("err", e))
        except Exception as e:  # noqa: BLE001 - any decoder failure fails this image only
            conn.send(("err", ImageDecodeError(f"cannot decode image: {type(e).__name__}: {e}")))


def _take_shared(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    shm = SharedMemory(name=name)
    try:
        return _to_tensor(np.ndarray(shape, np.uint8, buffer=shm.buf))
    finally:
        shm.close()
        shm.unlink()


class _Worker:
    def __init__(self, ctx: Any, process_fn: Callable) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, process_fn), daemon=True)
        self.process.start()
        child.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class PreprocessPool:
    """`submit(data, spec, multi_image, max_pixels)` -> Future[TileResult]."""

    def __init__(
        self,
        num_workers: int,
        max_pending: int = 64,
        process_fn: Callable = preprocess_bytes,
        start_method: str = "forkserver",
    ) -> None:
        if num_workers < 0 or max_pending < 1:
            raise ValueError(f"need num_workers >= 0 and max_pending >= 1, got "
                             f"{num_workers}, {max_pending}")  # fmt: skip
        self.num_workers, self.max_pending = num_workers, max_pending
        self.process_fn = process_fn
        self._slots = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._totals = {f.name: 0.0 for f in fields(StageTimings)}
        self.num_done = self.num_errors = self.num_crashes = 0
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

    def submit(self, *args: Any, timeout: float | None = None) -> Future:
        """Queue one image; blocks while `max_pending` are queued or running."""
        if self._closed:
            raise RuntimeError("the preprocessing pool is closed")
        if not self._slots.acquire(timeout=timeout if timeout is not None else -1):
            raise PreprocessBusyError(
                f"image preprocessing is saturated ({self.max_pending} images pending for "
                f"{timeout:.0f} s); retry later"
            )
        future: Future = Future()
        future.add_done_callback(lambda _: self._slots.release())
        if not self.workers:
            self._run_inline(future, args)
            return future
        with self._cond:
            self._tasks.append((future, args, time.perf_counter()))
            self._cond.notify()
        return future

    def try_submit(self, *args: Any) -> Future | None:
        """`submit` that returns None instead of waiting when the pool is full."""
        try:
            return self.submit(*args, timeout=0)
        except PreprocessBusyError:
            return None

    @property
    def num_pending(self) -> int:
        return self.max_pending - self._slots._value  # noqa: SLF001 - a gauge only

    def _run_inline(self, future: Future, args: tuple) -> None:
        future.set_running_or_notify_cancel()
        try:
            result = self.process_fn(*args)
            start = time.perf_counter()
            tiles = _to_tensor(np.ascontiguousarray(result.tiles))
            timings = StageTimings(0.0, 0.0, result.decode_s, result.resize_s,
                                   time.perf_counter() - start)  # fmt: skip
            self._finish(future, TileResult(tiles, timings))
        except RequestError as e:
            self._fail(future, e)
        except Exception as e:  # noqa: BLE001 - as in a worker: fails this image only
            self._fail(future, ImageDecodeError(f"cannot decode image: {type(e).__name__}: {e}"))

    # -- feeder threads ----------------------------------------------------------------

    def _next_task(self) -> tuple | None:
        with self._cond:
            while not self._tasks and not self._closed:
                self._cond.wait()
            return self._tasks.pop(0) if self._tasks else None

    def _feed(self, index: int) -> None:
        while (task := self._next_task()) is not None:
            future, args, queued_at = task
            if not future.set_running_or_notify_cancel():
                continue
            queue_s = time.perf_counter() - queued_at
            worker = self.workers[index]
            try:
                worker.conn.send(args)
                ready = wait([worker.conn, worker.process.sentinel])
                message = worker.conn.recv() if worker.conn in ready else None
            except (EOFError, OSError):
                message = None
            if message is None:
                self._replace(index, future)
            elif message[0] == "err":
                self._fail(future, message[1])
            else:
                _, name, shape, decode_s, resize_s, write_s = message
                start = time.perf_counter()
                tiles = _take_shared(name, shape)
                handoff_s = write_s + time.perf_counter() - start
                timings = StageTimings(queue_s, 0.0, decode_s, resize_s, handoff_s)
                self._finish(future, TileResult(tiles, timings))

    def _replace(self, index: int, future: Future) -> None:
        worker = self.workers[index]
        worker.process.join(timeout=1)
        code = worker.process.exitcode
        worker.conn.close()
        if not self._closed:  # replace first: whoever sees the failure sees a full pool
            self.workers[index] = _Worker(self._ctx, self.process_fn)
        with self._lock:
            self.num_crashes += 1
        self._fail(future, WorkerCrashedError(
            f"cannot decode image: the preprocessing worker died on it (exit code {code})"
        ))  # fmt: skip

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

    def record_read(self, seconds: float) -> None:
        with self._lock:
            self._totals["read_s"] += seconds

    def metrics(self) -> dict[str, float]:
        """Counters and per-stage seconds summed over finished images."""
        with self._lock:
            out: dict[str, float] = {f"{k}_total": v for k, v in self._totals.items()}
            out.update(images=self.num_done, errors=self.num_errors, crashes=self.num_crashes,
                       pending=self.num_pending, workers=self.num_workers)  # fmt: skip
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
        for future, _, _ in self._tasks:
            future.cancel()

    def __enter__(self) -> PreprocessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: dict[tuple[int, int], PreprocessPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(num_workers: int, max_pending: int) -> PreprocessPool:
    """One pool per (size, bound) per process: engines share it (the work is stateless,
    the spec travels with each image). Closed at interpreter exit."""
    with _SHARED_LOCK:
        key = (num_workers, max_pending)
        if key not in _SHARED:
            if not _SHARED:
                atexit.register(_close_shared)
            _SHARED[key] = PreprocessPool(num_workers, max_pending)
        return _SHARED[key]


def _close_shared() -> None:
    for pool in _SHARED.values():
        pool.close()
    _SHARED.clear()

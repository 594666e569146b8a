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
import contextlib
import itertools
import math
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, fields
from multiprocessing.connection import wait
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any

import numpy as np

from encoders.errors import ImageDecodeError, RequestError, RetryableError
from encoders.image_io import DEFAULT_MAX_PIXELS, preprocess_bytes, read_header
from encoders.pixel_budget import PixelBudget, shared_budget

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


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    import torch

    out = torch.empty(array.shape, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    out.numpy()[...] = array
    return out


_ARENA_STEP = 1 << 20  # arena sizes are whole MiB


class _TileArena:
    """A worker's shared-memory block, reused image after image: its pages stay mapped,
    so writing the next image's tiles costs no page faults and no create/unlink. It is
    replaced by a bigger one when an image needs more. Safe to reuse because the parent
    copies the tiles out before it sends this worker its next image. Blocks are named
    `prefix` + a counter, so the parent can find (and unlink) every block of a worker
    that died, even one made for the image it died on."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.made = prefix, 0
        self.block: SharedMemory | None = None
        self.array: np.ndarray | None = None  # this image's tiles, once allocated

    def alloc(self, shape: tuple[int, ...]) -> np.ndarray:
        """The process_fn's tile allocator (once per image: there is one block)."""
        assert self.array is None, "the tile arena gives one array per image"
        size = math.prod(shape)
        if self.block is None or self.block.size < size:
            self.free()
            self.made += 1
            step = _ARENA_STEP * math.ceil(max(size, 1) / _ARENA_STEP)
            self.block = SharedMemory(f"{self.prefix}{self.made}", create=True, size=step)
        self.array = np.ndarray(shape, np.uint8, buffer=self.block.buf)
        return self.array

    def hand_off(self, tiles: np.ndarray) -> str:
        """The name of the block now holding `tiles` (copied in if the process_fn did
        not use `alloc`)."""
        if tiles is not self.array:
            self.array = None
            self.alloc(tiles.shape)[...] = tiles
        assert self.block is not None
        return self.block.name

    def free(self) -> None:
        """Unlink and unmap the block (a mapping the parent holds stays valid)."""
        self.array = None
        if self.block is not None:
            self.block.unlink()
            try:
                self.block.close()
            except BufferError:  # a traceback still holds a view: unmapped when it goes
                pass
            self.block = None


def _keep_freed_memory(mmap_max: int = 32 << 20, keep: int = 256 << 20) -> None:
    """glibc malloc: serve buffers up to `mmap_max` from the heap and keep up to `keep`
    bytes of it when freed, instead of mapping and unmapping each large buffer (its
    adaptive threshold does not settle in a worker). Each image is then decoded and
    resized in pages already mapped: no page faults, about a third less CPU per tile on
    a VM. The worker keeps its peak heap. A no-op without glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-1, keep)  # M_TRIM_THRESHOLD
    mallopt(-3, mmap_max)  # M_MMAP_THRESHOLD (32 MiB: the largest every glibc accepts)


def _unlink_blocks(prefix: str) -> None:
    """Unlink every shared block whose name starts with `prefix` (Linux lists them in
    /dev/shm; elsewhere only the blocks the parent mapped are unlinked)."""
    if not os.path.isdir("/dev/shm"):
        return
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix):
            try:
                block = SharedMemory(name=name)
            except FileNotFoundError:
                continue
            block.unlink()
            block.close()


def _worker_main(conn: Any, process_fn: Callable, prefix: str) -> None:
    """Worker loop: args in, ("ok", arena name, shape, `Preprocessed` timings, write
    wall and CPU seconds) or ("err", exception) out; None or a closed pipe ends it.
    `process_fn(*args, alloc=...)` writes the tiles into `alloc(shape)` (the arena)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    _keep_freed_memory()
    arena = _TileArena(prefix)
    try:
        while True:
            try:
                args = conn.recv()
            except (EOFError, OSError):
                return
            if args is None:
                return
            try:
                result = process_fn(*args, alloc=arena.alloc)
                start, start_cpu = time.perf_counter(), time.thread_time()
                shape = result.tiles.shape
                times = (result.decode_s, result.resize_s, result.decode_cpu_s,
                         result.resize_cpu_s)  # fmt: skip
                name = arena.hand_off(result.tiles)
                del result  # no view on the arena outlives the image
                write = (time.perf_counter() - start, time.thread_time() - start_cpu)
                conn.send(("ok", name, shape, times, write))
            except RequestError as e:
                conn.send(("err", e))
            except Exception as e:  # noqa: BLE001 - any decoder failure fails this image only
                conn.send(("err", _unexpected(e)))
            finally:
                arena.array = None  # the next image allocates afresh
    finally:
        arena.free()


def _unexpected(e: Exception) -> RequestError:
    """The typed error for an untyped failure of the process_fn: named by its class only
    (its text may hold reprs or paths); out of memory is not the image's fault (503)."""
    if isinstance(e, MemoryError):
        return RetryableError("image preprocessing ran out of memory; retry later")
    return ImageDecodeError(f"cannot decode image: the decoder failed ({type(e).__name__})")


_worker_ids = itertools.count()
_start_lock = threading.Lock()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a worker without multiprocessing re-importing the parent's __main__ in it.
    Workers need nothing from it, and under `vlmserve` it is the whole CLI (transformers,
    the model code): seconds per worker on this 2-core machine, which made a pool-backed
    demo three times slower than decoding inline."""
    main = sys.modules.get("__main__")
    with _start_lock:
        if main is None:
            yield
            return
        saved_file = main.__dict__.pop("__file__", None)
        saved_spec, main.__spec__ = getattr(main, "__spec__", None), None
        try:
            yield
        finally:
            if saved_file is not None:
                main.__file__ = saved_file
            main.__spec__ = saved_spec


@contextlib.contextmanager
def _workers_wait_passively() -> Iterator[None]:
    """Workers (and the forkserver they fork from) start with passive OpenMP waiting where
    only the engine's own threads are to spin (VLMSERVE_SPIN_ENGINE_ONLY, set by
    vlmserve/__init__.py for the engine commands): a worker runs a parallel region now and
    then, and a thread spinning after it would take a core from the engine. Called with
    _start_lock held."""
    if os.environ.get("VLMSERVE_SPIN_ENGINE_ONLY") != "1":
        yield
        return
    saved = os.environ.pop("GOMP_SPINCOUNT", None)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        del os.environ["OMP_WAIT_POLICY"]
        if saved is not None:
            os.environ["GOMP_SPINCOUNT"] = saved


class _Worker:
    def __init__(self, ctx: Any, process_fn: Callable) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.prefix = f"vlm{os.getpid():x}_{next(_worker_ids)}_"  # its blocks' names
        self.process = ctx.Process(target=_worker_main, args=(child, process_fn, self.prefix),
                                   daemon=True)  # fmt: skip
        with _main_module_hidden(), _workers_wait_passively():
            self.process.start()
        child.close()
        self.arena: SharedMemory | None = None  # our mapping of the worker's arena

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Copy the tiles out of the worker's arena (mapped once, remapped if it grew)."""
        if self.arena is None or self.arena.name != name:
            self.unmap()
            self.arena = SharedMemory(name=name)
        return _to_tensor(np.ndarray(shape, np.uint8, buffer=self.arena.buf))

    def unmap(self, unlink: bool = False) -> None:
        """Drop our mapping; with `unlink`, also every block of a worker that died without
        freeing them."""
        if self.arena is not None:
            if unlink:
                try:
                    self.arena.unlink()
                except FileNotFoundError:
                    pass
            self.arena.close()
            self.arena = None
        if unlink:
            _unlink_blocks(self.prefix)

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
        self.unmap(unlink=self.process.exitcode != 0)


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

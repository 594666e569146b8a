"""The preprocessing pool's worker processes (encoders/preprocess.py drives them): the
worker loop, its reused shared-memory tile arena, and the parent's handle on one worker
(start with the parent's __main__ hidden and passive OpenMP waiting, copy tiles out, stop,
unlink a dead worker's blocks).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any

import numpy as np

from encoders.errors import ImageDecodeError, RequestError, RetryableError
from kernels.malloc_tuning import PORTABLE_MMAP_THRESHOLD, keep_freed_memory

if TYPE_CHECKING:
    import torch


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
    # Each image is decoded and resized in heap pages already mapped (glibc's adaptive
    # threshold does not settle in a worker): no page faults, less CPU per tile.
    keep_freed_memory(PORTABLE_MMAP_THRESHOLD, 256 << 20)
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
    the model code): seconds per worker on a small machine, which made a pool-backed demo
    slower than decoding inline."""
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

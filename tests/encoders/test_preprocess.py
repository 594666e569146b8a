"""The preprocessing pool: same tiles as inline, typed errors per image, backpressure,
a crashed worker replaced and its image retried once (then a retryable 503), the pixel
budget held from submit to result, per-stage timings."""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from encoders.errors import ImageBusyError, ImageTooLargeError, RetryableError
from encoders.image_io import (
    Preprocessed,
    TruncatedImageError,
    UnsupportedImageError,
    preprocess_bytes,
)
from encoders.image_spec import ImageSpec
from encoders.pixel_budget import PixelBudget
from encoders.preprocess import PreprocessPool, WorkerCrashedError

SPEC = ImageSpec("idefics3", 32, 1, (0.5,) * 3, (0.5,) * 3, longest_edge=96, image_seq_len=4)


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def crash_or_tile(data: bytes, *args, alloc=None) -> Preprocessed:
    """A process_fn whose worker dies on b"crash" and dawdles on b"slow" (module level so
    spawned workers can import it). It ignores `alloc`: the worker copies the tiles."""
    if data == b"crash":
        os._exit(3)
    if data == b"slow":
        time.sleep(0.5)
    tiles = np.full((1, 2, 2, 3), len(data) % 256, dtype=np.uint8)
    return Preprocessed(tiles, 0.001, 0.002)


def stall_first_time(data: bytes, spec, multi_image, max_pixels, marker: str, *,
                     alloc) -> Preprocessed:  # fmt: skip
    """The real decode; the first attempt (no `marker` file yet) creates the marker and
    keeps decoding the image over and over, for the test to kill the worker mid-decode."""
    if not Path(marker).exists():
        Path(marker).touch()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            preprocess_bytes(data, spec, multi_image, max_pixels)
    return preprocess_bytes(data, spec, multi_image, max_pixels, alloc=alloc)


def grow_then_crash(data: bytes, *args, alloc) -> Preprocessed:
    """A process_fn that writes a small image into its arena, or grows the arena for a
    big one and dies before reporting the new block."""
    if data == b"grow and crash":
        alloc((4, 512, 512, 3))[...] = 1
        os._exit(4)
    tiles = alloc((1, 8, 8, 3))
    tiles[...] = 7
    return Preprocessed(tiles, 0.001, 0.002)


@pytest.fixture(scope="module")
def pool():
    with PreprocessPool(num_workers=2, max_pending=8) as pool:
        yield pool


def test_pool_gives_the_inline_tiles_and_timings(pool) -> None:
    images = [jpeg(90, 50, 1), jpeg(640, 480, 2), jpeg(20, 300, 3)]
    futures = [pool.submit(data, SPEC, False, 10**8) for data in images]
    with PreprocessPool(num_workers=0) as inline:
        expected = [inline.submit(data, SPEC, False, 10**8).result() for data in images]
    for future, want in zip(futures, expected, strict=True):
        got = future.result(timeout=60)
        assert got.tiles.dtype == want.tiles.dtype and bool((got.tiles == want.tiles).all())
        t = got.timings
        assert t.decode_s > 0 and t.resize_s > 0 and t.handoff_s > 0 and t.queue_s >= 0
    metrics = pool.metrics()
    assert metrics["images"] >= 3 and metrics["decode_s_total"] > 0 and metrics["workers"] == 2


def test_bad_images_fail_with_their_typed_error_only(pool) -> None:
    good = jpeg(64, 64)
    futures = [pool.submit(d, SPEC, False, 10**8) for d in (good[:300], b"nope", good)]
    with pytest.raises(TruncatedImageError):
        futures[0].result(timeout=60)
    with pytest.raises(UnsupportedImageError):
        futures[1].result(timeout=60)
    assert futures[2].result(timeout=60).tiles.shape[0] >= 1


def test_an_image_that_kills_every_worker_gets_a_retryable_503() -> None:
    """A poison image kills its worker and the replacement it is retried on: a 503 that
    says retry (not a 400 that blames the image); only it fails, the pool keeps serving."""
    with PreprocessPool(num_workers=2, max_pending=4, process_fn=crash_or_tile) as pool:
        before = list(pool.workers)
        futures = [pool.submit(d, SPEC, False, 0) for d in (b"crash", b"ok", b"fine!")]
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\) on each of 2") as info:
            futures[0].result(timeout=60)
        assert info.value.status == 503 and isinstance(info.value, RetryableError)
        assert "retry" in str(info.value) and "decode image" not in str(info.value)
        assert [f.result(timeout=60).tiles[0, 0, 0, 0].item() for f in futures[1:]] == [2, 5]
        after = [pool.submit(b"again", SPEC, False, 0) for _ in range(4)]
        assert all(f.result(timeout=60).tiles[0, 0, 0, 0].item() == 5 for f in after)
        metrics = pool.metrics()
        assert metrics["crashes"] == 2 and metrics["retries"] == 1
        replaced = [old for old, new in zip(before, pool.workers, strict=True) if old is not new]
        assert [old.process.exitcode for old in replaced] == [3]
        assert all(w.process.is_alive() for w in pool.workers)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="lists blocks in /dev/shm (Linux)")
def test_a_worker_killed_mid_image_is_replaced_and_the_image_retried(tmp_path) -> None:
    """SIGKILL (the OOM killer, an operator) on the worker decoding a big image: the
    image is redone on the replacement and succeeds; no shared block is left behind."""
    data = jpeg(1600, 1200)
    before = shared_blocks()
    marker = tmp_path / "started"
    with PreprocessPool(num_workers=1, max_pending=4, process_fn=stall_first_time) as pool:
        victim = pool.workers[0].process
        future = pool.submit(data, SPEC, False, 10**8, str(marker))
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert marker.exists() and not future.done()
        os.kill(victim.pid, signal.SIGKILL)
        got = future.result(timeout=120)
        want = preprocess_bytes(data, SPEC, False, 10**8)
        assert np.array_equal(got.tiles.numpy(), want.tiles)
        assert pool.metrics()["crashes"] == 1 and pool.metrics()["retries"] == 1
        assert victim.exitcode == -signal.SIGKILL and pool.workers[0].process is not victim
    assert shared_blocks() <= before


@pytest.mark.slow
def test_backpressure_bounds_the_pending_images() -> None:
    with PreprocessPool(num_workers=1, max_pending=2, process_fn=crash_or_tile) as pool:
        held = [pool.submit(b"slow", SPEC, False, 0) for _ in range(2)]
        assert pool.num_pending == 2
        assert pool.try_submit(b"x", SPEC, False, 0) is None  # full: refused, not queued
        start = time.perf_counter()
        late = pool.submit(b"x", SPEC, False, 0, timeout=30)  # waits for a free slot
        assert time.perf_counter() - start > 0.2
        assert all(f.result(timeout=60) is not None for f in [*held, late])
        assert pool.num_pending == 0
        # Without a timeout, submit waits as long as it takes (a burst past max_pending).
        burst = [pool.submit(b"slow", SPEC, False, 0) for _ in range(5)]
        assert all(f.result(timeout=60) is not None for f in burst)


def shared_blocks() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_tiles_cross_in_a_reused_block_that_grows_and_is_freed() -> None:
    """Each worker writes tiles into one shared block, grown for a bigger image; every
    result stays intact after later images reuse it, and closing leaves no block."""
    spec = ImageSpec("idefics3", 128, 1, (0.5,) * 3, (0.5,) * 3, longest_edge=1024,
                     image_seq_len=4)  # fmt: skip
    sizes = [(1000, 100), (900, 700), (300, 30), (1200, 1100), (50, 50)]  # 9, 49, 9, 65, 65 tiles
    images = [jpeg(w, h, i) for i, (w, h) in enumerate(sizes)]
    before = shared_blocks()
    with PreprocessPool(num_workers=1, max_pending=8) as pool:
        got = [f.result(timeout=60) for f in [pool.submit(d, spec, False, 10**8) for d in images]]
        assert pool.submit(b"nope", spec, False, 10**8).exception(timeout=60) is not None
    with PreprocessPool(num_workers=0) as inline:
        want = [inline.submit(d, spec, False, 10**8).result() for d in images]
    assert want[0].tiles.numel() < 1 << 20 < want[1].tiles.numel()  # the block grows
    for g, w in zip(got, want, strict=True):
        assert g.tiles.shape == w.tiles.shape and bool((g.tiles == w.tiles).all())
        assert g.timings.decode_cpu_s > 0 and g.timings.resize_cpu_s > 0
    assert shared_blocks() <= before


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="lists blocks in /dev/shm (Linux)")
def test_a_dead_workers_blocks_are_unlinked_even_one_it_never_reported() -> None:
    before = shared_blocks()
    with PreprocessPool(num_workers=1, max_pending=4, process_fn=grow_then_crash) as pool:
        assert pool.submit(b"small", SPEC, False, 0).result(timeout=60).tiles[0, 0, 0, 0] == 7
        assert len(shared_blocks() - before) == 1  # the worker's arena
        with pytest.raises(WorkerCrashedError, match="exit code 4"):  # twice: retried once
            pool.submit(b"grow and crash", SPEC, False, 0).result(timeout=60)
        assert shared_blocks() <= before  # both blocks gone, the pool still open
        assert pool.submit(b"small", SPEC, False, 0).result(timeout=60).tiles[0, 0, 0, 0] == 7
    assert shared_blocks() <= before


def test_submit_holds_the_images_pixels_until_its_result() -> None:
    """A budget of one image's pixels: submits wait for the previous image's result, the
    reservations never overlap, and all are released."""
    images = [jpeg(320, 240, seed) for seed in range(3)]
    budget = PixelBudget(320 * 240)
    with PreprocessPool(num_workers=2, max_pending=8, budget=budget) as pool:
        futures = [pool.submit(data, SPEC, False, 10**8, timeout=60) for data in images]
        assert all(f.result(timeout=60).tiles.shape[0] >= 1 for f in futures)
        assert budget.max_in_use == 320 * 240
        with pytest.raises(ImageTooLargeError, match="whole decode budget"):
            pool.submit(jpeg(400, 300), SPEC, False, 10**8)
        with budget.reserve(100 * 100):
            with pytest.raises(ImageBusyError):
                pool.submit(images[0], SPEC, False, 10**8, timeout=0.2)
            assert pool.try_submit(images[0], SPEC, False, 10**8) is None
        assert pool.num_pending == 0
        failed = pool.submit(b"nope", SPEC, False, 10**8, num_pixels=5000)
        assert failed.exception(timeout=60) is not None
        metrics = pool.metrics()
    assert budget.in_use == 0 and metrics["decode_pixels_in_use"] == 0
    assert metrics["decode_budget_timeouts"] == 2


def test_read_seconds_reach_the_result_and_the_totals(pool) -> None:
    total = pool.metrics()["read_s_total"]
    result = pool.submit(jpeg(40, 30), SPEC, False, 10**8, read_s=0.25).result(timeout=60)
    assert result.timings.read_s == 0.25 and result.timings.total_s >= 0.25
    assert pool.metrics()["read_s_total"] == pytest.approx(total + 0.25)
    with PreprocessPool(num_workers=0) as inline:
        assert (
            inline.submit(jpeg(40, 30), SPEC, False, 10**8, read_s=0.5).result().timings.read_s
            == 0.5
        )
        assert inline.metrics()["read_s_total"] == 0.5

"""One request image -> RGB + hash: the allow-listed opener at every entry point (an EPS
never reaches Ghostscript), clean messages over the fuzz corpus, and the pixel budget
that bounds concurrent decodes."""

from __future__ import annotations

import io
import re
import threading
import time

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image

from benchmarks.reliability.corpus import EPS, generate_corpus
from encoders.config import EncoderConfig
from encoders.errors import (
    ImageBusyError,
    ImageDecodeError,
    ImageTooLargeError,
    RequestError,
    RetryableError,
)
from encoders.image_io import (
    UnsupportedImageError,
    decode_rgb,
    preprocess_bytes,
    read_header,
)
from encoders.image_spec import ImageSpec
from encoders.images import content_hash, load_image, open_rgb
from encoders.pixel_budget import PixelBudget
from vlmserve.server.media import check_image_header

SPEC = ImageSpec("idefics3", 32, 3, (0.5,) * 3, (0.5,) * 3, longest_edge=96, image_seq_len=4)
LEAKS = re.compile(r"\b0x[0-9a-f]{6,}|/tmp/|gs |Traceback|<.* object at")


def png(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, "PNG")
    return buffer.getvalue()


# -- the allow-list -----------------------------------------------------------------------


@pytest.fixture
def fake_ghostscript(tmp_path, monkeypatch):
    """A `gs` first on PATH that leaves a marker file when anything runs it."""
    marker = tmp_path / "gs-ran"
    gs = tmp_path / "bin" / "gs"
    gs.parent.mkdir()
    gs.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{gs.parent}:/usr/bin:/bin")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # PIL caches its lookup
    return marker


def test_the_fake_ghostscript_is_what_pil_would_run(fake_ghostscript) -> None:
    """The control: PIL left to itself identifies the bytes as EPS and runs `gs`."""
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever PIL makes of gs failing
        Image.open(io.BytesIO(EPS)).load()
    assert fake_ghostscript.exists()


@pytest.mark.parametrize(
    "entry",
    [
        lambda data: read_header(data),
        lambda data: decode_rgb(data),
        lambda data: preprocess_bytes(data, SPEC, False),
        lambda data: load_image(data),
        lambda data: load_image(io.BytesIO(data).getvalue()),
        lambda data: check_image_header(data, 10**8),
    ],
    ids=["read_header", "decode_rgb", "preprocess_bytes", "load_image", "load_bytes", "media"],
)
def test_eps_is_refused_at_every_entry_point_without_running_ghostscript(
    entry, fake_ghostscript
) -> None:
    with pytest.raises(UnsupportedImageError, match="format EPS is not supported") as info:
        entry(EPS)
    assert info.value.status == 400
    assert "supported: JPEG, PNG, WebP, GIF, BMP" in str(info.value)
    assert not fake_ghostscript.exists()


def test_load_image_from_a_path_uses_the_same_opener(tmp_path, fake_ghostscript) -> None:
    path = tmp_path / "looks.png"
    path.write_bytes(EPS)
    with pytest.raises(UnsupportedImageError, match="EPS"):
        load_image(path)
    assert not fake_ghostscript.exists()
    with pytest.raises(ImageDecodeError, match="cannot read image file") as info:
        load_image(tmp_path / "missing.png")
    assert "No such file" in str(info.value)


@pytest.mark.parametrize(
    ("fmt", "name"),
    [("TIFF", "TIFF"), ("PDF", "PDF"), ("ICO", "ICO"), ("PPM", "PNM"), ("QOI", "QOI"),
     ("DDS", "DDS"), ("ICNS", "ICNS")],
)  # fmt: skip
def test_other_formats_pil_knows_are_refused_by_name(fmt, name) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (1, 2, 3)).save(buffer, fmt)
    with pytest.raises(UnsupportedImageError, match=f"format {name} is not supported"):
        load_image(buffer.getvalue())


def test_a_broken_header_of_a_supported_format_is_corrupt_not_unsupported() -> None:
    with pytest.raises(ImageDecodeError, match="PNG header is corrupt or truncated"):
        read_header(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    with pytest.raises(UnsupportedImageError, match="unrecognised bytes"):
        read_header(b"just some text")


def test_load_image_decodes_like_the_pool() -> None:
    """Same orientation, alpha compositing and 16-bit scaling as `decode_rgb`."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.new("RGBA", (30, 20), (10, 20, 30, 0)).save(buffer, "WEBP", exif=exif.tobytes())
    data = buffer.getvalue()
    image, digest = load_image(data)
    assert image.mode == "RGB" and image.size == (20, 30)
    assert np.array_equal(np.asarray(image), np.asarray(decode_rgb(data)[0]))
    assert digest == content_hash(data)
    pil, pil_digest = load_image(Image.new("LA", (5, 4), (7, 0)))
    assert pil.mode == "RGB" and pil.getpixel((0, 0)) == (255, 255, 255)
    assert pil_digest == load_image(Image.new("LA", (5, 4), (7, 0)))[1] != digest


def test_pil_images_get_the_same_size_checks() -> None:
    with pytest.raises(ImageDecodeError, match="zero size 0x4"):
        load_image(Image.new("RGB", (0, 4)))
    with pytest.raises(ImageTooLargeError, match="over the limit of 100"):
        load_image(Image.new("RGB", (20, 20)), max_pixels=100)


# -- the fuzz corpus ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return generate_corpus(tmp_path_factory.mktemp("corpus"), seed=1, num_bad=60)


def test_corpus_covers_every_category(corpus) -> None:
    kinds = {item.kind for item in corpus}
    assert sum(item.expect == "bad" for item in corpus) == 60
    for kind in ("truncated_png", "wrong_magic", "lying_header", "huge_dimensions", "zero_size",
                 "bomb", "unsupported_format", "polyglot_bad", "png_text_bomb", "cmyk_jpeg",
                 "png_16bit_rgb", "la_png", "1bit_png", "exif_rotation_6", "apng",
                 "animated_webp", "thin_1x50000"):  # fmt: skip
        assert kind in kinds, kind


def test_corpus_items_decode_or_raise_a_clean_request_error(corpus) -> None:
    """Every "ok" item decodes through both paths; every "bad" one raises a RequestError
    subclass (4xx) whose message leaks no repr, path or command line."""
    for item in corpus:
        data = item.path.read_bytes()
        for entry in (load_image, lambda d: preprocess_bytes(d, SPEC, False)):
            try:
                entry(data)
                got = "ok"
            except RequestError as e:
                got = "bad"
                assert 400 <= e.status < 500, (item.path.name, e.status)
                assert str(e) and not LEAKS.search(str(e)), (item.path.name, str(e))
            assert got == item.expect, (item.path.name, got)


# -- the pixel budget ---------------------------------------------------------------------


def test_concurrent_decodes_never_overlap_past_the_budget() -> None:
    """Four threads decode images of 400x300 under a budget of one such image: the
    reservations never overlap, and each tiles inside its own."""
    budget = PixelBudget(400 * 300)
    images = [png(400, 300, seed) for seed in range(4)]
    holders, max_holders, lock, errors = [0], [0], threading.Lock(), []

    def decode(data: bytes) -> None:
        try:
            with open_rgb(data, budget=budget, timeout=60) as (image, _):
                with lock:
                    holders[0] += 1
                    max_holders[0] = max(max_holders[0], holders[0])
                image.resize((32, 32))
                time.sleep(0.05)
                with lock:
                    holders[0] -= 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=decode, args=(data,)) for data in images]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and max_holders[0] == 1
    assert budget.max_in_use == 400 * 300 and budget.in_use == 0
    budget.check_integrity()


def test_an_image_over_the_whole_budget_is_refused_at_once() -> None:
    budget = PixelBudget(100 * 100)
    start = time.perf_counter()
    with pytest.raises(ImageTooLargeError, match="over the whole decode budget") as info:
        load_image(png(200, 100), budget=budget, timeout=30)
    assert info.value.status == 413 and time.perf_counter() - start < 10
    assert budget.in_use == 0


def test_waiting_past_the_timeout_is_a_retryable_503() -> None:
    budget = PixelBudget(100 * 100)
    with budget.reserve(60 * 60):
        with pytest.raises(ImageBusyError, match="retry later") as info:
            load_image(png(90, 90), budget=budget, timeout=0.2)
        assert info.value.status == 503 and isinstance(info.value, RetryableError)
        assert load_image(png(40, 40), budget=budget, timeout=0.2)[0].size == (40, 40)  # fits
    assert budget.in_use == 0 and budget.num_timeouts == 1


def test_waiters_are_served_in_arrival_order() -> None:
    """A big image that waits is not overtaken by small ones that would fit."""
    budget = PixelBudget(100)
    order: list[str] = []
    with budget.reserve(60):
        big = threading.Thread(target=lambda: (budget.acquire(100, 30), order.append("big")))
        big.start()
        while not budget._waiters:  # noqa: SLF001 - wait until it is queued
            time.sleep(0.01)
        small = threading.Thread(target=lambda: (budget.acquire(10, 30), order.append("small")))
        small.start()
        time.sleep(0.2)
        assert order == []  # 10 would fit, but the big one is first in line
    big.join(timeout=30)
    budget.release(100)
    small.join(timeout=30)
    budget.release(10)
    assert order == ["big", "small"] and budget.in_use == 0


def test_encoder_config_sizes_the_budget() -> None:
    assert EncoderConfig().resolved_max_decode_pixels == 2 * EncoderConfig().max_pixels
    assert EncoderConfig(max_pixels=10, max_decode_pixels=15).resolved_max_decode_pixels == 15
    with pytest.raises(ValueError, match="max_decode_pixels=5"):
        EncoderConfig(max_pixels=10, max_decode_pixels=5)

"""A generated corpus of bad and odd images, each with the answer the server must give.

`generate_corpus(out_dir, seed, num_bad)` writes real files and returns one `CorpusItem`
per file: `expect="ok"` must decode (HTTP 200), `expect="bad"` must be refused with a
typed `RequestError` (HTTP 4xx with a message), never a 5xx or a crash.

What the project accepts (`encoders.image_io.ALLOWED_FORMATS`): JPEG (and MPO), PNG (and
APNG, first frame), WebP (first frame), GIF (first frame) and BMP. So:
  * ok: every mode PIL decodes to RGB (CMYK, 16-bit, palette, LA, 1-bit, RGBA), every
    EXIF orientation, animations (first frame), extreme but small shapes (1x50000), and
    supported images with harmless bytes around them (a ZIP after a PNG's IEND, HTML in a
    JPEG comment), and PNG/JPEG whose compressed stream ends before the declared rows (the
    decoders fill the rest, as browsers do);
  * bad: truncations, wrong magic, headers that declare more pixels than the data holds,
    declared sizes over the pixel cap (bombs, 413), zero sizes, text/ZIP/HTML bodies,
    every other format PIL knows (TIFF, EPS, PDF, ICO, ...: 400 naming the format),
    polyglots whose first bytes are not a supported image, PNGs whose text or ICC chunk
    inflates past PIL's limit.
The categories are fixed; `seed` draws the cut offsets, sizes and noise. Run as a program
it writes the corpus and prints the counts: `python -m benchmarks.reliability.corpus DIR`.
"""

from __future__ import annotations

import argparse
import functools
import io
import random
import struct
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["CorpusItem", "generate_corpus"]

Expect = Literal["ok", "bad"]


@dataclass(frozen=True)
class CorpusItem:
    path: Path
    kind: str  # the category, e.g. "truncated_png", "exif_rotation_6", "bomb_gif"
    expect: Expect


# -- building blocks ---------------------------------------------------------------------


def _noise(rng: np.random.Generator, width: int, height: int, mode: str = "RGB") -> Image.Image:
    """A noisy RGB picture with a shape on it (never blank, compresses like a photo)."""
    pixels = rng.integers(1, 255, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, width // 2, height // 2), (250, 0, 0))
    return image if mode == "RGB" else image.convert(mode)


def _save(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kw)
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(
    width: int, height: int, idat: bytes, depth: int = 8, color: int = 2, extra: bytes = b""
) -> bytes:
    """A PNG from parts; `idat` is the already-compressed stream; `extra` goes before it."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + extra
            + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b""))  # fmt: skip


@functools.cache
def _png_rows(height: int, bytes_per_row: int) -> bytes:
    """The compressed IDAT stream of `height` all-zero rows (filter type 0)."""
    compressor, row = zlib.compressobj(9), b"\x00" * (1 + bytes_per_row)
    return b"".join([*(compressor.compress(row) for _ in range(height)), compressor.flush()])


def _gif(width: int, height: int, frame: tuple[int, int], lzw: bytes) -> bytes:
    """A GIF89a whose logical screen is width x height with one `frame`-sized image."""
    screen = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0)
    palette = bytes([0, 0, 0, 255, 255, 255])
    descriptor = b"," + struct.pack("<HHHHB", 0, 0, *frame, 0)
    return screen + palette + descriptor + b"\x02" + bytes([len(lzw)]) + lzw + b"\x00;"


def _bmp_header(width: int, height: int, bpp: int = 24, data_len: int = 0) -> bytes:
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, bpp, 0, data_len, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + data_len, 0, 0, 54) + info


def _with_jpeg_size(jpeg: bytes, width: int, height: int) -> bytes:
    """The JPEG with its SOF frame header rewritten to declare width x height."""
    at = next(i for i in range(2, len(jpeg) - 9) if jpeg[i] == 0xFF and jpeg[i + 1] in (0xC0, 0xC2))
    return jpeg[: at + 5] + struct.pack(">HH", height, width) + jpeg[at + 9 :]


def _with_png_size(png: bytes, width: int, height: int) -> bytes:
    """The PNG with IHDR declaring width x height (CRC fixed, so only the size lies)."""
    ihdr = struct.pack(">II", width, height) + png[24:29]
    return png[:8] + _png_chunk(b"IHDR", ihdr) + png[33:]


def _webp_vp8l_header(width: int, height: int) -> bytes:
    """A lossless WebP whose header declares width x height over a few bytes of stream."""
    bits = (width - 1) | (height - 1) << 14  # 14 bits each, then alpha + version = 0
    vp8l = b"\x2f" + struct.pack("<I", bits) + b"\x00" * 8
    chunk = b"VP8L" + struct.pack("<I", len(vp8l)) + vp8l
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def _webp_vp8x_header(width: int, height: int) -> bytes:
    """An extended WebP whose canvas is width x height (24-bit fields) with no frames."""
    vp8x = (
        b"\x00\x00\x00\x00" + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    )
    chunk = b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def _tiff_header(width: int, height: int) -> bytes:
    """A little-endian TIFF declaring width x height, 8-bit grey, with one strip of 8 bytes."""
    entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 1),
               (262, 3, 1, 1), (273, 4, 1, 8 + 2 + 12 * 8 + 4), (278, 4, 1, height),
               (279, 4, 1, 8)]  # fmt: skip
    ifd = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHII", tag, kind, count, value) for tag, kind, count, value in entries
    )
    return b"II*\x00" + struct.pack("<I", 8) + ifd + b"\x00" * 4 + b"\x00" * 8


EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n%%EndComments\n"
    b"(%stdout) (w) file (ghostscript ran) writestring\n"
    b"newpath 0 0 moveto 16 16 lineto stroke showpage\n%%EOF\n"
)


def _dos_eps(payload: bytes) -> bytes:
    """A DOS EPS binary header (C5D0D3C6) wrapping PostScript and a `payload` preview."""
    ps_at = 30
    header = b"\xc5\xd0\xd3\xc6" + struct.pack("<IIIIII", ps_at, len(EPS), 0, 0,
                                               ps_at + len(EPS), len(payload))  # fmt: skip
    return header + b"\xff\xff" + EPS + payload


# -- the good and odd-but-valid images ---------------------------------------------------


def _exif_jpeg(rng: np.random.Generator, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(_noise(rng, 40, 24), "JPEG", exif=exif.tobytes())


def _animated(
    rng: np.random.Generator, fmt: str, num_frames: int = 3, first: Image.Image | None = None
) -> bytes:
    frames = [_noise(rng, 32, 24) if first is None else first for _ in range(num_frames)]
    frames[1:] = [_noise(rng, *frames[0].size) for _ in frames[1:]]
    kw: dict = {"save_all": True, "append_images": frames[1:], "duration": 50, "loop": 0}
    if fmt == "WEBP":
        kw["lossless"] = True
    return _save(frames[0], fmt, **kw)


def _png16(rng: np.random.Generator, color: int) -> bytes:
    """16-bit grey (color 0) or RGB (color 2), written by hand (PIL saves neither RGB)."""
    channels = 1 if color == 0 else 3
    pixels = rng.integers(0, 65535, (12, 20 * channels), dtype=np.uint16).astype(">u2")
    rows = b"".join(b"\x00" + row.tobytes() for row in pixels)
    return _png(20, 12, zlib.compress(rows), depth=16, color=color)


def _good(rng: np.random.Generator) -> list[tuple[str, bytes]]:
    base = _noise(rng, 64, 48)
    thin_row = zlib.compress(b"".join(b"\x00" + b"\x80" for _ in range(50_000)))
    wide_row = zlib.compress(b"\x00" + b"\x80" * 50_000)
    cmyk = _save(base.convert("CMYK"), "JPEG")
    return [
        ("good_png", _save(base, "PNG")),
        ("good_jpeg", _save(base, "JPEG", quality=90)),
        ("good_jpeg_progressive", _save(base, "JPEG", progressive=True)),
        ("good_webp_lossy", _save(base, "WEBP", quality=80)),
        ("good_webp_lossless", _save(base, "WEBP", lossless=True)),
        ("good_gif", _save(base.convert("P"), "GIF")),
        ("good_bmp", _save(base, "BMP")),
        ("grey_jpeg", _save(base.convert("L"), "JPEG")),
        ("cmyk_jpeg", cmyk),
        ("png_16bit_grey", _png16(rng, 0)),
        ("png_16bit_rgb", _png16(rng, 2)),
        ("palette_png", _save(base.convert("P"), "PNG")),
        ("palette_png_transparency", _save(base.convert("P"), "PNG", transparency=0)),
        ("la_png", _save(base.convert("LA"), "PNG")),
        ("rgba_png", _save(base.convert("RGBA"), "PNG")),
        ("rgba_webp", _save(base.convert("RGBA"), "WEBP")),
        ("1bit_png", _save(base.convert("1"), "PNG")),
        ("1bit_bmp", _save(base.convert("1"), "BMP")),
        ("palette_bmp", _save(base.convert("P"), "BMP")),
        *[(f"exif_rotation_{o}", _exif_jpeg(rng, o)) for o in range(1, 9)],
        ("animated_gif", _animated(rng, "GIF")),
        ("animated_gif_many_frames", _animated(rng, "GIF", 60)),
        ("animated_webp", _animated(rng, "WEBP")),
        ("apng", _animated(rng, "PNG")),
        ("thin_1x50000", _png(1, 50_000, thin_row, color=0)),
        ("wide_50000x1", _png(50_000, 1, wide_row, color=0)),
        ("short_data_png", _with_png_size(_save(base, "PNG"), 64, 48 * 8)),
        ("short_data_jpeg", _with_jpeg_size(_save(base, "JPEG"), 64, 48 * 8)),
        ("tiny_1x1", _save(Image.new("RGB", (1, 1), (9, 99, 199)), "PNG")),
        ("polyglot_png_then_zip", _save(base, "PNG") + b"PK\x03\x04" + bytes(rng.bytes(200))),
        ("polyglot_jpeg_html_comment", _save(base, "JPEG", comment=b"<script>alert(1)</script>")),
        ("polyglot_gif_then_html", _save(base.convert("P"), "GIF") + b"<html><body>x</body>"),
    ]


# -- the bad ones ------------------------------------------------------------------------

Maker = Callable[[random.Random, np.random.Generator], bytes]


def _truncated(base: bytes, end: int) -> Maker:
    """`base` cut at a random offset before 90% of `end` (where the data of the frame
    we decode ends), so pixel data is always missing."""
    return lambda r, _: base[: r.randrange(0, int(end * 0.9))]


def _wrong_magic(r: random.Random, rng: np.random.Generator) -> bytes:
    magics = [
        b"\x89PNG\r\n\x1a\n",
        b"\xff\xd8\xff\xe0",
        b"GIF89a",
        b"BM",
        b"RIFF\x00\x00\x00\x00WEBP",
    ]
    bodies = [_save(_noise(rng, 24, 16), fmt) for fmt in ("PNG", "JPEG", "GIF", "BMP", "WEBP")]
    i, j = r.sample(range(len(magics)), 2)  # the magic of one format on another's body
    return magics[i] + bodies[j][len(magics[j]) :]


def _magic_then_noise(r: random.Random, rng: np.random.Generator) -> bytes:
    magic = r.choice([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM",
                      b"RIFF\x10\x00\x00\x00WEBPVP8 "])  # fmt: skip
    return magic + rng.bytes(r.randrange(0, 400))


def _not_an_image(r: random.Random, rng: np.random.Generator) -> bytes:
    return r.choice([
        b"", b"\x00", b"\x89", b"\x89PNG", b"hello", b'{"image": "nope"}',
        b"<html><body>not an image</body></html>", b"\x00" * r.randrange(1, 5000),
        rng.bytes(r.randrange(1, 2000)), b"PK\x03\x04" + rng.bytes(100),
        b"#!/bin/sh\necho pwned\n", b"GIF89a/*" + b"*/=alert(1);",
    ])  # fmt: skip


def _lying_header(r: random.Random, rng: np.random.Generator) -> bytes:
    """A header that declares more rows than the data holds (still under the cap), in a
    format whose decoder then runs out of data: BMP rows, a GIF frame's LZW stream. (A PNG
    or JPEG whose compressed stream ends early decodes, missing rows filled, as in a
    browser: those are the "ok" `short_data_*` items.)"""
    width, height = r.randrange(16, 64), r.randrange(16, 64)
    image = _noise(rng, width, height)
    grow = r.randrange(4, 40)
    if r.random() < 0.5:
        data = _save(image, "BMP")
        return data[:22] + struct.pack("<i", height * grow) + data[26:]
    data = _save(image.convert("P"), "GIF")  # the frame descriptor's height
    at = data.index(b"\x2c", 13 + 768)
    return data[: at + 7] + struct.pack("<H", height * grow) + data[at + 9 :]


def _huge_dims(r: random.Random, rng: np.random.Generator) -> bytes:
    """Declared sizes far over the default 64 Mpx cap, a few bytes of data."""
    side = r.choice([10_000, 30_000, 65_535])
    kind = r.choice(["png", "jpeg", "bmp", "gif", "webp"])
    if kind == "png":
        return _with_png_size(_save(_noise(rng, 8, 8), "PNG"), side, side)
    if kind == "jpeg":
        return _with_jpeg_size(_save(_noise(rng, 8, 8), "JPEG"), side, side)
    if kind == "bmp":
        return _bmp_header(side, side) + rng.bytes(64)
    if kind == "gif":
        return _gif(side, side, (side, side), b"\x4c\x01")
    return _webp_vp8l_header(min(side, 16_384), min(side, 16_384))


def _zero_size(r: random.Random, rng: np.random.Generator) -> bytes:
    width, height = r.choice([(0, 0), (0, 10), (10, 0)])
    kind = r.choice(["png", "gif", "bmp", "jpeg"])
    if kind == "png":
        return _png(width, height, _png_rows(1, 3))
    if kind == "gif":
        return _gif(width, height, (width, height), b"\x4c\x01")
    if kind == "bmp":
        return _bmp_header(width, height)
    return _with_jpeg_size(_save(_noise(rng, 8, 8), "JPEG"), width, height)


def _bomb(r: random.Random, rng: np.random.Generator) -> bytes:
    """A small file whose header declares a huge pixel count: a real 1-bit PNG of zeros,
    a GIF, a WebP, a TIFF."""
    kind = r.choice(["png", "gif", "webp_vp8l", "webp_vp8x", "tiff"])
    if kind == "png":
        side = r.choice([20_000, 40_000])
        return _png(side, side, _png_rows(side, side // 8), depth=1, color=0)
    if kind == "gif":
        return _gif(65_535, 65_535, (65_535, 65_535), b"\x4c\x01")
    if kind == "webp_vp8l":
        return _webp_vp8l_header(16_384, 16_384)
    if kind == "webp_vp8x":
        return _webp_vp8x_header(1 << 24, 1 << 24)
    return _tiff_header(100_000, 100_000)


def _unsupported(r: random.Random, rng: np.random.Generator) -> bytes:
    """Another format PIL can write (or a hand-made EPS/PS/SVG/HEIC)."""
    image = _noise(rng, r.randrange(8, 40), r.randrange(8, 40))
    fmt = r.choice(["TIFF", "EPS", "PDF", "ICO", "ICNS", "PPM", "PCX", "TGA", "SGI", "IM",
                    "DDS", "XBM", "QOI", "BLP", "SPIDER", "MSP", "hand_eps", "ps", "svg",
                    "heic", "psd", "jp2"])  # fmt: skip
    if fmt == "hand_eps":
        return EPS
    if fmt == "ps":
        return b"%!PS\n(ran) print\nshowpage\n"
    if fmt == "svg":
        return b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'
    if fmt == "heic":
        return b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + rng.bytes(64)
    if fmt == "psd":
        return (
            b"8BPS\x00\x01" + b"\x00" * 6 + struct.pack(">HIIHH", 3, 16, 16, 8, 3) + rng.bytes(64)
        )
    if fmt == "jp2":
        return b"\x00\x00\x00\x0cjP  \r\n\x87\n" + rng.bytes(64)
    if fmt in ("XBM", "MSP"):
        image = image.convert("1")
    elif fmt in ("SPIDER",):
        image = image.convert("F")
    elif fmt == "ICNS":
        image = image.resize((16, 16))
    elif fmt in ("BLP",):
        image = image.convert("P")
    return _save(image, fmt)


def _bad_polyglot(r: random.Random, rng: np.random.Generator) -> bytes:
    """A supported image inside something whose first bytes are another format."""
    png = _save(_noise(rng, 16, 16), "PNG")
    return r.choice([
        _dos_eps(png),  # EPS with a "preview" (PIL would run Ghostscript on it)
        b"%PDF-1.4\n1 0 obj<<>>stream\n" + _save(_noise(rng, 16, 16), "JPEG") + b"\nendstream",
        b"PK\x03\x04" + b"\x00" * 26 + png,
        b"<html><img src=x onerror=alert(1)>" + png,
        EPS + png,
    ])  # fmt: skip


def _text_bomb(r: random.Random, rng: np.random.Generator) -> bytes:
    """A tiny PNG with a zTXt or iCCP chunk that inflates past PIL's 1 MiB text limit."""
    inflated = _inflating(r.choice([2 << 20, 16 << 20]))
    kind = r.choice([b"zTXt", b"iCCP"])
    chunk = _png_chunk(kind, b"Comment\x00\x00" + inflated)
    return _png(8, 8, _png_rows(8, 24), extra=chunk)


@functools.cache
def _inflating(size: int) -> bytes:
    return zlib.compress(b"A" * size, 9)


def _bad_makers(rng: np.random.Generator) -> list[tuple[str, Maker, int]]:
    """(kind, maker, weight): the weight is the share of `num_bad` each gets."""
    base = _noise(rng, 96, 64)
    bases = {
        "png": _save(base, "PNG"), "jpeg": _save(base, "JPEG"),
        "jpeg_progressive": _save(base, "JPEG", progressive=True), "webp": _save(base, "WEBP"),
        "webp_lossless": _save(base, "WEBP", lossless=True), "gif": _save(base.convert("P"), "GIF"),
        "bmp": _save(base, "BMP"), "animated_gif": _animated(rng, "GIF", first=base),
        "apng": _animated(rng, "PNG", first=base),
    }  # fmt: skip
    # An animation cut after its first frame still decodes (first frame only): cut those
    # within the first frame, about as long as the same frame saved alone.
    first = {"animated_gif": len(_save(base.convert("P"), "GIF")), "apng": len(bases["png"])}
    truncations = [(f"truncated_{name}", _truncated(data, first.get(name, len(data))), 3)
                   for name, data in bases.items()]  # fmt: skip
    return [
        *truncations,
        ("wrong_magic", _wrong_magic, 3),
        ("magic_then_noise", _magic_then_noise, 3),
        ("not_an_image", _not_an_image, 2),
        ("lying_header", _lying_header, 4),
        ("huge_dimensions", _huge_dims, 3),
        ("zero_size", _zero_size, 2),
        ("bomb", _bomb, 3),
        ("unsupported_format", _unsupported, 5),
        ("polyglot_bad", _bad_polyglot, 2),
        ("png_text_bomb", _text_bomb, 1),
    ]


def generate_corpus(out_dir: Path, seed: int = 0, num_bad: int = 500) -> list[CorpusItem]:
    """Write the corpus under `out_dir` (created) and return its items, good ones first.
    `num_bad` bad files (at least one per category); about 40 good and odd ones."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    r, rng = random.Random(seed), np.random.default_rng(seed)
    items = []
    for kind, data in _good(rng):
        items.append(_write(out_dir, len(items), kind, data, "ok"))
    makers = _bad_makers(rng)
    total = sum(weight for _, _, weight in makers)
    counts = [max(1, num_bad * weight // total) for _, _, weight in makers]
    for i in range(num_bad - sum(counts)):  # the rounding remainder, spread round-robin
        counts[i % len(counts)] += 1
    for (kind, maker, _), count in zip(makers, counts, strict=True):
        for _ in range(count):
            items.append(_write(out_dir, len(items), kind, maker(r, rng), "bad"))
    return items


def _write(out_dir: Path, index: int, kind: str, data: bytes, expect: Expect) -> CorpusItem:
    path = out_dir / f"{index:04d}_{expect}_{kind}.bin"
    path.write_bytes(data)
    return CorpusItem(path, kind, expect)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-bad", type=int, default=500)
    args = parser.parse_args()
    items = generate_corpus(args.out_dir, args.seed, args.num_bad)
    counts = Counter((item.expect, item.kind) for item in items)
    for (expect, kind), count in sorted(counts.items()):
        print(f"{expect:4} {kind:32} {count}")
    print(f"{len(items)} files in {args.out_dir}")


if __name__ == "__main__":
    main()

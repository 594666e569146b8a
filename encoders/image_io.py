"""One image from encoded bytes to uint8 tiles: header, decode, resize, tile.

Runs inside the preprocessing workers (`encoders.preprocess`), so it imports no torch.
  * `open_image`: the project's only PIL opener for request bytes. It tries only the
    plugins of `ALLOWED_FORMATS` (so EPS never reaches Ghostscript, TIFF never reaches
    libtiff) and turns every failure into a typed error whose message names the problem
    (unsupported format X, truncated, corrupt, zero size, too large) without PIL's text.
  * `read_header`: format and size (after EXIF orientation) without decoding pixels, so
    the exact token count is known before the decode; rejects zero-size images, pixel
    bombs and unsupported formats early.
  * `decode_rgb`: JPEG draft mode (libjpeg's DCT downscale by 2/4/8) when every resample
    target is at least 2x smaller; still opaque WebP straight to RGB with libwebp (PIL
    decodes it through its animation decoder); EXIF orientation, first frame of
    animations, palette / alpha (composited on white, as transformers does) / CMYK /
    16-bit -> RGB.
  * `tile_image`: the family's resample chain with PIL (pillow-simd when installed),
    bit-identical to the transformers PIL-backend processor on the same decoded image.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import io
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from encoders.errors import ImageDecodeError, ImageTooLargeError
from encoders.image_spec import ImageLayout, ImageSpec
from encoders.tiling.anyres import AnyresLayout
from encoders.tiling.internvl import InternVLLayout
from encoders.tiling.pan_and_scan import PanAndScanLayout

__all__ = [
    "ALLOWED_FORMATS", "CorruptImageError", "ImageHeader", "TruncatedImageError",
    "UnsupportedImageError", "ZeroSizeImageError", "decode_opened", "decode_rgb", "open_checked",
    "open_image",
    "preprocess_bytes", "read_header", "tile_image",
]  # fmt: skip

# The only PIL plugins ever tried on request bytes (`Image.open(formats=...)`): PIL never
# identifies anything else, so EPS/PS/PDF (Ghostscript), TIFF (libtiff), ICNS, PSD, ... are
# refused before any of their code runs. The JPEG plugin also opens MPO (JPEG's
# multi-picture variant); APNG, GIF and animated WebP decode their first frame only.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
SUPPORTED_FORMATS = frozenset({*ALLOWED_FORMATS, "MPO"})  # what `image.format` can be
SUPPORTED_TEXT = "JPEG, PNG, WebP, GIF, BMP"
DEFAULT_MAX_PIXELS = 64_000_000
_SWAPS_AXES = {5, 6, 7, 8}  # EXIF orientations that transpose the image

# Leading bytes -> format name, to name what was refused (or which supported format a
# broken header claims to be). Checked in order; offset 4 for the ISO-BMFF "ftyp" family.
_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\x89PNG\r\n\x1a\n", "PNG"), (0, b"\xff\xd8\xff", "JPEG"), (0, b"GIF8", "GIF"),
    (0, b"BM", "BMP"), (0, b"%!PS-Adobe", "EPS"), (0, b"%!", "PostScript"),
    (0, b"\xc5\xd0\xd3\xc6", "EPS"), (0, b"%PDF", "PDF"), (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"), (0, b"II+\x00", "BigTIFF"), (0, b"MM\x00+", "BigTIFF"),
    (0, b"icns", "ICNS"), (0, b"8BPS", "PSD"), (0, b"\x00\x00\x01\x00", "ICO"),
    (0, b"\x00\x00\x02\x00", "CUR"), (0, b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (0, b"\xffO\xffQ", "JPEG 2000"), (0, b"qoif", "QOI"), (0, b"DDS ", "DDS"),
    (0, b"BLP", "BLP"), (0, b"\x01\xda", "SGI"), (0, b"8BIM", "PSD"), (0, b"FORM", "IFF"),
    (0, b"\xff\x0a", "JPEG XL"), (0, b"\x00\x00\x00\x0cJXL ", "JPEG XL"),
    (0, b"\xd7\xcd\xc6\x9a", "WMF"), (0, b"\x01\x00\x00\x00", "EMF"),
    (0, b"Image type=", "IM"), (0, b"PK\x03\x04", "ZIP"), (4, b"ftypavif", "AVIF"),
    (4, b"ftypheic", "HEIC"), (4, b"ftypheix", "HEIC"), (4, b"ftypmif1", "HEIF"),
)  # fmt: skip


class CorruptImageError(ImageDecodeError):
    """Bytes that claim a format but do not decode."""


class TruncatedImageError(ImageDecodeError):
    """A file cut short (an interrupted upload)."""


class UnsupportedImageError(ImageDecodeError):
    """Not an image format we accept."""


class ZeroSizeImageError(ImageDecodeError):
    """An image with no pixels (or no bytes)."""


@dataclass(frozen=True)
class ImageHeader:
    format: str
    width: int  # after EXIF orientation: what the model sees
    height: int
    orientation: int

    @property
    def num_pixels(self) -> int:
        return self.width * self.height


def sniff_format(data: bytes) -> str | None:
    """The format the leading bytes announce (names for refused formats too), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    head = data[:64].lstrip()
    if head[:5].lower() in (b"<svg ", b"<?xml"):
        return "SVG/XML"
    if head[:1] == b"P" and head[1:2] in b"1234567" and len(head) > 2 and head[2:3].isspace():
        return "PNM"
    return next((name for at, magic, name in _MAGIC if data[at : at + len(magic)] == magic), None)


def _unsupported(data: bytes) -> ImageDecodeError:
    """The error for bytes no allowed plugin identified: a broken header of a supported
    format, or a format we do not take (named when its magic says which)."""
    name = sniff_format(data)
    if name in SUPPORTED_FORMATS:
        return CorruptImageError(f"cannot decode image: its {name} header is corrupt or truncated")
    what = f"format {name}" if name else "this format (unrecognised bytes)"
    return UnsupportedImageError(
        f"cannot decode image: {what} is not supported (supported: {SUPPORTED_TEXT})"
    )


def _decode_failure(e: BaseException, fmt: str | None) -> ImageDecodeError:
    """A typed error for a PIL/codec exception, naming what went wrong but never echoing
    its text (which can hold reprs with addresses, file names or codec internals)."""
    what = f"{fmt} data" if fmt else "data"
    if (
        isinstance(e, (OSError, EOFError))
        and "truncated" in str(e).lower()
        or isinstance(e, EOFError)
    ):
        return TruncatedImageError(f"cannot decode image: its {what} is truncated")
    return CorruptImageError(f"cannot decode image: its {what} is corrupt")


def open_image(data: bytes) -> Image.Image:
    """The project's one way to open request bytes with PIL: only `ALLOWED_FORMATS` are
    tried, the header is parsed (no pixels decoded), and every failure is a typed
    `RequestError` with a clean message (never PIL's text)."""
    if not data:
        raise ZeroSizeImageError("cannot decode image: it is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bomb warnings, odd EXIF, palette transparency
            return Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageTooLargeError(
            f"image rejected as a decompression bomb: it declares over "
            f"{2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels"
        ) from e
    except UnidentifiedImageError as e:
        raise _unsupported(data) from e
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - plugins raise OSError, ValueError, EOFError, ...
        raise _decode_failure(e, sniff_format(data)) from e


def _check_header(image: Image.Image, max_pixels: int) -> ImageHeader:
    assert image.format in SUPPORTED_FORMATS, f"{image.format} opened past the allow-list"
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ZeroSizeImageError(f"cannot decode image: it has zero size {width}x{height}")
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}"
        )
    orientation = _orientation(image)
    if orientation in _SWAPS_AXES:
        width, height = height, width
    return ImageHeader(image.format, width, height, orientation)


def _orientation(image: Image.Image) -> int:
    """EXIF orientation from what the header parse already read (PNG's `getexif` would
    decode the whole image to look for a trailing eXIf chunk)."""
    try:
        if image.format in ("JPEG", "MPO", "WEBP"):
            exif = image.getexif()
        elif "exif" in image.info:
            exif = Image.Exif()
            exif.load(image.info["exif"])
        else:
            return 1
        return int(exif.get(0x0112, 1))
    except Exception:  # noqa: BLE001 - a broken EXIF block is not worth failing the image
        return 1


def open_checked(
    data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[Image.Image, ImageHeader]:
    """`open_image` plus the header checks: zero size, the pixel cap, EXIF orientation."""
    image = open_image(data)
    return image, _check_header(image, max_pixels)


def read_header(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageHeader:
    """Format and oriented size from the header alone (no pixel decode)."""
    return open_checked(data, max_pixels)[1]


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB. Transparency is composited on white (transformers'
    `convert_to_rgb`); 16/32-bit greyscale is scaled to 8 bits (PIL's plain convert would
    clip everything above 255 to white)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        array = np.asarray(image, dtype=np.uint32)
        shift = 8 if image.mode != "I" or array.max(initial=0) > 255 else 0
        image = Image.fromarray((array >> shift).clip(0, 255).astype(np.uint8), "L")
    if image.mode == "F":
        image = Image.fromarray(np.asarray(image).clip(0, 255).astype(np.uint8), "L")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_rgb(
    data: bytes,
    draft_size: tuple[int, int] | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[Image.Image, ImageHeader]:
    """Decode to an oriented RGB image. `draft_size` (width, height, oriented): the
    smallest size the caller resamples to; JPEGs then decode at 1/2, 1/4 or 1/8 scale
    as long as the result stays at least that big."""
    image, header = open_checked(data, max_pixels)
    return decode_opened(data, image, header, draft_size), header


def decode_opened(
    data: bytes, image: Image.Image, header: ImageHeader, draft_size: tuple[int, int] | None
) -> Image.Image:
    """`decode_rgb` on an image from `open_checked` (so a caller can reserve the header's
    pixels between the two)."""
    if draft_size is not None and header.orientation in _SWAPS_AXES:
        draft_size = draft_size[1], draft_size[0]  # the stored (unrotated) frame's size
    try:
        if (direct := _webp_rgb(data, image)) is not None:
            image = direct
        else:
            image.seek(0)  # first frame of an animation
            if draft_size is not None and image.format in ("JPEG", "MPO"):
                image.draft("RGB", draft_size)
            image.load()
        if header.orientation in _TRANSPOSE:
            image = image.transpose(_TRANSPOSE[header.orientation])
        return to_rgb(image)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - decoders raise OSError, zlib.error, ValueError, ...
        raise _decode_failure(e, header.format) from e


_TRANSPOSE = {  # EXIF orientation -> the transposition that undoes it
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90,
}  # fmt: skip


@functools.cache
def _libwebp() -> ctypes.CDLL | None:
    """libwebp for `_webp_rgb`: the copy PIL links (so the pixels are PIL's), else the
    system's; None where neither loads."""
    import PIL

    bundled = sorted((Path(PIL.__file__).parent.parent / "pillow.libs").glob("libwebp-*.so*"))
    for path in filter(None, [*map(str, bundled), ctypes.util.find_library("webp")]):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "WebPDecodeRGBInto"):
            decode = lib.WebPDecodeRGBInto  # (data, size, out, out size, stride) -> out | NULL
            decode.restype = ctypes.c_void_p
            decode.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_int]  # fmt: skip
            return lib
    return None


def _webp_rgb(data: bytes, image: Image.Image) -> Image.Image | None:
    """A still, opaque WebP decoded by libwebp's simple API straight to RGB (PIL decodes
    every WebP with its animation decoder, to RGBA or RGBX: 35% more CPU with the copy
    into PIL included, same pixels); None for anything else (alpha, animation, no
    libwebp, a decode error: PIL then decodes or reports it). No draft: libwebp's scaled
    decode saved under 5% (the VP8 decode is the cost) and moved pixels more than JPEG's."""
    if image.format != "WEBP" or image.mode != "RGB" or getattr(image, "is_animated", False):
        return None
    if (lib := _libwebp()) is None:
        return None
    width, height = image.size
    pixels = np.empty((height, width, 3), np.uint8)
    if not lib.WebPDecodeRGBInto(data, len(data), pixels.ctypes.data, pixels.nbytes, 3 * width):
        return None
    return Image.fromarray(pixels)


Alloc = Callable[[tuple[int, ...]], np.ndarray]  # shape -> uint8 array to write tiles into


def empty_tiles(shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, dtype=np.uint8)


def tile_image(
    image: Image.Image, spec: ImageSpec, layout: ImageLayout, alloc: Alloc = empty_tiles
) -> np.ndarray:
    """The family's resize/pad/crop chain -> uint8 tiles [num_tiles, S, S, 3], in the
    order the tower takes them. Geometry comes from `layout` (computed from the original
    size), so a draft-decoded smaller `image` lands on the same tiles. `alloc(shape)`
    gives the array the tiles are written into (shared memory in a pool worker)."""
    size, resample = spec.tile_size, spec.resample
    tiles = alloc((layout.num_tiles, size, size, 3))
    if isinstance(layout, AnyresLayout):
        if layout.multi_image:
            side = layout.best_resolution[0]
            fill = tuple(int(m * 255) for m in spec.image_mean)
            canvas = Image.new("RGB", (side, side), fill)
            canvas.paste(image, layout.padding[:2])
            tiles[0] = np.asarray(canvas.resize((size, size), resample))
            return tiles
        # Base tile first, then the grid of the image resized into the zero-padded
        # canvas. Each resize starts from the decoded image, as transformers' does.
        tiles[0] = np.asarray(image.resize((size, size), resample))
        new_height, new_width = layout.resized
        grid = np.asarray(image.resize((new_width, new_height), resample))
        _cut_tiles(grid, tiles[1:], layout.grid, layout.padding[1], layout.padding[0])
        return tiles
    if isinstance(layout, InternVLLayout):
        # InternVL: the grid from one resize of the decoded image, the thumbnail (last)
        # from another (the embedded model's SceneProcessor, bit for bit).
        height1, width1 = layout.resized
        grid_tiles = tiles[:-1] if layout.has_thumbnail else tiles
        _cut_tiles(np.asarray(_resize(image, (width1, height1), resample)), grid_tiles, layout.grid)
        if layout.has_thumbnail:
            tiles[-1] = np.asarray(_resize(image, (size, size), resample))
        return tiles
    if isinstance(layout, PanAndScanLayout):
        # Gemma 3: the whole image, then each crop cut from the decoded image (a crop, not
        # a resize box: PIL's box would read pixels past the crop's edge), each squashed
        # to one tile, as transformers' Gemma3 image processor does.
        tiles[0] = np.asarray(_resize(image, (size, size), resample))
        for tile, box in zip(tiles[1:], layout.crops, strict=True):
            tile[...] = np.asarray(_resize(image.crop(box), (size, size), resample))
        return tiles
    height1, width1 = layout.resized
    image = _resize(image, (width1, height1), resample)  # longest edge -> spec.longest_edge
    if not spec.do_image_splitting:
        tiles[0] = np.asarray(image.resize((size, size), resample))
        return tiles
    split_h, split_w = layout.split_size
    image = _resize(image, (split_w, split_h), resample)  # sides -> multiples of the tile
    if layout.grid == (0, 0):
        tiles[0] = np.asarray(image)  # already one tile
        return tiles
    _cut_tiles(np.asarray(image), tiles[:-1], layout.grid)
    tiles[-1] = np.asarray(image.resize((size, size), resample))  # the global image, last
    return tiles


def _resize(image: Image.Image, size: tuple[int, int], resample: int) -> Image.Image:
    """`image.resize`, minus the copy PIL makes when the size is already right."""
    return image if image.size == size else image.resize(size, resample)


def _cut_tiles(
    pixels: np.ndarray, out: np.ndarray, grid: tuple[int, int], top: int = 0, left: int = 0
) -> None:
    """Cut a canvas of `grid` (rows, cols) tiles, zero except for `pixels` [H, W, 3] at
    (top, left), into `out` [rows * cols, S, S, 3] row-major. Copies each pixel once (no
    padded canvas in between); `out` may hold garbage on entry."""
    rows, cols = grid
    size = out.shape[1]
    height, width = pixels.shape[:2]
    if (top, left, height, width) == (0, 0, rows * size, cols * size):  # no padding
        out.reshape(rows, cols, size, size, 3)[...] = pixels.reshape(
            rows, size, cols, size, 3
        ).swapaxes(1, 2)
        return
    for row in range(rows):
        for col in range(cols):
            tile = out[row * cols + col]
            y0, x0 = row * size - top, col * size - left  # tile origin in `pixels`
            ya, yb = max(y0, 0) - y0, min(y0 + size, height) - y0  # covered, tile coords
            xa, xb = max(x0, 0) - x0, min(x0 + size, width) - x0
            if ya >= yb or xa >= xb:
                tile[...] = 0
                continue
            tile[ya:yb, xa:xb] = pixels[y0 + ya : y0 + yb, x0 + xa : x0 + xb]
            tile[:ya] = 0
            tile[yb:] = 0
            tile[ya:yb, :xa] = 0
            tile[ya:yb, xb:] = 0


@dataclass(frozen=True)
class Preprocessed:
    """A worker's result: uint8 tiles plus its stage timings (seconds; wall clock, and the
    thread's CPU time, which a loaded machine does not inflate)."""

    tiles: np.ndarray  # [num_tiles, S, S, 3] uint8
    decode_s: float
    resize_s: float
    decode_cpu_s: float = 0.0
    resize_cpu_s: float = 0.0


def preprocess_bytes(
    data: bytes,
    spec: ImageSpec,
    multi_image: bool,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    alloc: Alloc = empty_tiles,
) -> Preprocessed:
    """Encoded bytes -> tiles (what a pool worker runs for one image); the tiles go into
    `alloc(shape)`."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    image, header = open_checked(data, max_pixels)
    layout = spec.layout(header.width, header.height, multi_image)
    image = decode_opened(data, image, header, spec.draft_size(layout) if spec.jpeg_draft else None)
    decoded, decoded_cpu = time.perf_counter(), time.thread_time()
    tiles = tile_image(image, spec, layout, alloc)
    return Preprocessed(tiles, decoded - start, time.perf_counter() - decoded,
                        decoded_cpu - start_cpu, time.thread_time() - decoded_cpu)  # fmt: skip

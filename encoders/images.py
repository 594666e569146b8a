"""Reading one request image into RGB pixels plus the hash of its content.

Bytes go through the same allow-listed opener and header checks as the preprocessing
pool (`encoders.image_io`), and the decode holds a reservation on the process's pixel
budget (`encoders.pixel_budget`). The hash keys the prefix cache (and later the
encoder-output cache): raw file bytes when we have them, otherwise the decoded pixels.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

from encoders.errors import ImageDecodeError, ImageTooLargeError
from encoders.image_io import (
    DEFAULT_MAX_PIXELS,
    ZeroSizeImageError,
    decode_opened,
    open_checked,
    to_rgb,
)
from encoders.pixel_budget import DEFAULT_BUDGET_TIMEOUT_S, PixelBudget, shared_budget

__all__ = ["ImageSource", "content_hash", "load_image", "open_rgb", "read_source"]

ImageSource = Image.Image | bytes | str | Path


def content_hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def read_source(source: bytes | str | Path) -> bytes:
    """The bytes of a path or bytes-like source."""
    if isinstance(source, (str, Path)):
        try:
            return Path(source).read_bytes()
        except OSError as e:
            raise ImageDecodeError(f"cannot read image file {str(source)!r}: {e.strerror}") from e
    return bytes(source)


@contextlib.contextmanager
def open_rgb(
    source: ImageSource,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    budget: PixelBudget | None = None,
    timeout: float | None = DEFAULT_BUDGET_TIMEOUT_S,
) -> Iterator[tuple[Image.Image, bytes]]:
    """(oriented RGB image, content hash), with the image's pixels reserved on `budget`
    (None: the process's default, `shared_budget(2 * max_pixels)`) until the block
    exits: tile inside the block, so the decode and its tiles count together.
    Raises ImageDecodeError subclasses (400), ImageTooLargeError (413: over `max_pixels`
    or the whole budget) or ImageBusyError (503 after waiting `timeout` s for room)."""
    budget = shared_budget(2 * max_pixels) if budget is None else budget
    if isinstance(source, Image.Image):
        width, height = source.size
        _check_size(width, height, max_pixels)
        with budget.reserve(width * height, timeout):
            image = to_rgb(source)
            digest = content_hash(f"{source.mode}:{source.size}:".encode() + source.tobytes())
            yield image, digest
        return
    data = read_source(source)
    image, header = open_checked(data, max_pixels)
    with budget.reserve(header.num_pixels, timeout):
        yield decode_opened(data, image, header, None), content_hash(data)


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ZeroSizeImageError(f"cannot decode image: it has zero size {width}x{height}")
    if width * height > max_pixels:
        raise ImageTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}"
        )


def load_image(
    source: ImageSource,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    budget: PixelBudget | None = None,
    timeout: float | None = DEFAULT_BUDGET_TIMEOUT_S,
) -> tuple[Image.Image, bytes]:
    """(RGB image, content hash): `open_rgb` with the reservation held for the decode
    only. Raises what `open_rgb` raises."""
    with open_rgb(source, max_pixels, budget, timeout) as (image, digest):
        return image, digest

"""Reading one request image into RGB pixels plus the hash of its content.

The hash keys the prefix cache (and later the encoder-output cache): raw file bytes when
we have them, otherwise the decoded pixels.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from encoders.errors import ImageDecodeError, ImageTooLargeError

ImageSource = Image.Image | bytes | str | Path


def content_hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def load_image(source: ImageSource, max_pixels: int = 64_000_000) -> tuple[Image.Image, bytes]:
    """(RGB image, content hash). Raises ImageDecodeError / ImageTooLargeError."""
    if isinstance(source, Image.Image):
        image = source
        digest = content_hash(f"{image.mode}:{image.size}:".encode() + image.tobytes())
    else:
        if isinstance(source, (str, Path)):
            try:
                data = Path(source).read_bytes()
            except OSError as e:
                raise ImageDecodeError(f"cannot read image file {str(source)!r}: {e}") from e
        else:
            data = bytes(source)
        if not data:
            raise ImageDecodeError("image is empty (0 bytes)")
        digest = content_hash(data)
        try:
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > max_pixels:
                raise ImageTooLargeError(
                    f"image is {image.width}x{image.height} = {image.width * image.height} "
                    f"pixels, over the limit of {max_pixels}"
                )
            image = ImageOps.exif_transpose(image)
            image.load()
        except ImageTooLargeError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise ImageDecodeError(f"cannot decode image: {e}") from e
        except Image.DecompressionBombError as e:
            raise ImageTooLargeError(f"image rejected as a decompression bomb: {e}") from e
    if image.width == 0 or image.height == 0:
        raise ImageDecodeError(f"image has zero size {image.width}x{image.height}")
    if image.mode != "RGB":
        image = image.convert("RGB")
    return image, digest

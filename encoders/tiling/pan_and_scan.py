"""Gemma 3 as a tiling family: pan-and-scan crops, exact token count and prompt text from
the image's (width, height) alone.

The rule is transformers' `Gemma3ImageProcessor.pan_and_scan` line for line: an image whose
long side is at least `min_ratio` times its short side is cut along the long side into
2..`max_crops` equal crops (about one per unit of aspect ratio, each at least
`min_crop_size` pixels), unless the crops would be smaller than that. The whole image
comes first, then the crops; each is resized to one tile and gives `tokens_per_image`
tokens, wrapped in its own `<start_of_image>` ... `<end_of_image>` (`gemma3_prompt_text`:
`Gemma3Processor.replace_image_token`'s layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PanAndScanLayout", "gemma3_prompt_text", "pan_and_scan_crops", "pan_and_scan_layout"]

_CROPS_SENTENCE = "and here are some crops to help you see better"  # Gemma3Processor's words


@dataclass(frozen=True)
class PanAndScanLayout:
    width: int
    height: int
    crops: tuple[tuple[int, int, int, int], ...]  # (left, top, right, bottom), row-major
    num_tiles: int  # 1 + len(crops)
    num_tokens: int


def pan_and_scan_crops(
    width: int, height: int, *, min_crop_size: int, max_crops: int, min_ratio: float
) -> tuple[tuple[int, int, int, int], ...]:
    """The crop boxes of a width x height image; () when the rule does not apply."""
    if width >= height:
        if width / height < min_ratio:
            return ()
        num_w = min(int(math.floor(width / min_crop_size)), int(math.floor(width / height + 0.5)))
        num_w, num_h = min(max_crops, max(2, num_w)), 1
    else:
        if height / width < min_ratio:
            return ()
        num_h = min(int(math.floor(height / min_crop_size)), int(math.floor(height / width + 0.5)))
        num_w, num_h = 1, min(max_crops, max(2, num_h))
    crop_w, crop_h = int(math.ceil(width / num_w)), int(math.ceil(height / num_h))
    if min(crop_w, crop_h) < min_crop_size:
        return ()
    # Slices past the edge stop at it, as the tensor slicing in transformers does.
    return tuple(
        (x, y, min(x + crop_w, width), min(y + crop_h, height))
        for y in range(0, crop_h * num_h, crop_h)
        for x in range(0, crop_w * num_w, crop_w)
    )


def pan_and_scan_layout(
    width: int,
    height: int,
    *,
    tokens_per_image: int,
    enabled: bool,
    min_crop_size: int = 256,
    max_crops: int = 4,
    min_ratio: float = 1.2,
) -> PanAndScanLayout:
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    crops = ()
    if enabled:
        crops = pan_and_scan_crops(
            width, height, min_crop_size=min_crop_size, max_crops=max_crops, min_ratio=min_ratio
        )
    num_tiles = 1 + len(crops)
    return PanAndScanLayout(width, height, crops, num_tiles, num_tiles * tokens_per_image)


def gemma3_prompt_text(
    num_crops: int, tokens_per_image: int, *, boi_token: str, eoi_token: str, image_token: str
) -> str:
    """The text one image's `<start_of_image>` marker becomes (so tokenising the expanded
    prompt gives the processor's ids): the whole image's tokens between the begin/end
    markers, and with crops the processor's fixed sentence around each crop's own."""
    full = f"\n\n{boi_token}{image_token * tokens_per_image}{eoi_token}\n\n"
    if not num_crops:
        return full
    crops = " ".join([full] * num_crops)
    return f"Here is the original image {full} {_CROPS_SENTENCE} {crops}"

"""LLaVA-OneVision anyres tiling as a pure function of the image's (width, height).

The rule (transformers' `LlavaOnevisionImageProcessor` + `LlavaOnevisionProcessor`):
  * `select_best_resolution` picks the grid pinpoint (height, width) that keeps the most
    of the image and wastes the least;
  * the image is resized into it keeping its aspect ratio (`get_patch_output_size`: the
    constrained side fills the pinpoint, the other is `ceil`-ed), centred, zero-padded;
  * the padded canvas is cut into tile_size squares row-major, after a BASE tile that is
    the whole image squashed to tile_size x tile_size (base first);
  * tokens: the base tile's patches, then the grid's patch map with the padding rows or
    columns removed ("unpadding"), shrunk by `anyres_max_N` when it holds more than
    1.1x N tiles' worth, each row closed by an image_newline token.
  * An image of a multi-image prompt is padded to a square (with the mean colour) and
    becomes the base tile only: its patches + one newline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from encoders.connectors import anyres_num_tokens, select_best_resolution

__all__ = ["AnyresLayout", "anyres_layout", "patch_output_size"]


@dataclass(frozen=True)
class AnyresLayout:
    """Where an image's pixels go and how many tokens they become."""

    width: int
    height: int
    best_resolution: tuple[int, int]  # (height, width) of the padded canvas
    resized: tuple[int, int]  # (height, width) of the image inside the canvas
    padding: tuple[int, int, int, int]  # (left, top, right, bottom) zeros around it
    grid: tuple[int, int]  # (rows, cols) of grid tiles; (0, 0) for a multi-image prompt
    num_tiles: int  # base tile + rows * cols
    num_tokens: int
    multi_image: bool = False


def patch_output_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized into `target` (height, width) keeping its
    aspect ratio (transformers' `get_patch_output_size`)."""
    target_height, target_width = target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def anyres_layout(
    width: int,
    height: int,
    *,
    tile_size: int,
    grid_pinpoints: Sequence[Sequence[int]],
    num_patches: int,
    max_num_patches: int,
    select_strategy: str = "full",
    multi_image: bool = False,
) -> AnyresLayout:
    """The anyres layout of a width x height image. `num_patches`: tokens of one tile
    (the processor's `num_image_tokens`, e.g. 27 * 27 = 729)."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    drop = 1 if select_strategy == "default" else 0
    if multi_image:
        side = max(width, height)
        left, top = (side - width) // 2, (side - height) // 2
        padding = (left, top, side - width - left, side - height - top)
        return AnyresLayout(width, height, (side, side), (height, width), padding, (0, 0), 1,
                            num_patches + 1 - drop, multi_image=True)  # fmt: skip
    best = select_best_resolution((height, width), grid_pinpoints)
    new_height, new_width = patch_output_size(height, width, best)
    pad_x, rest_x = divmod(best[1] - new_width, 2)
    pad_y, rest_y = divmod(best[0] - new_height, 2)
    rows, cols = best[0] // tile_size, best[1] // tile_size
    num_tiles = 1 + rows * cols
    num_tokens = anyres_num_tokens(
        num_tiles, num_patches, (height, width), grid_pinpoints, tile_size, max_num_patches
    )
    return AnyresLayout(width, height, best, (new_height, new_width),
                        (pad_x, pad_y, pad_x + rest_x, pad_y + rest_y), (rows, cols), num_tiles,
                        num_tokens - drop)  # fmt: skip

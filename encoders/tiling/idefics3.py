"""Idefics3 / SmolVLM image splitting as a pure function of the image's (width, height).

The rule (transformers' `Idefics3ImageProcessor`, shared by SmolVLM):
  1. resize so the longest edge is `longest_edge` (up or down; the other side
     `int(...)`-rounded, then bumped to even), capped at 4096;
  2. with splitting on, resize again so both sides are multiples of `tile_size`
     (the long side `ceil`-ed to a multiple, the short side derived from it and `ceil`-ed);
  3. if that is larger than one tile, cut it into tile_size squares row-major and append
     the whole image squashed to one tile LAST (the global image); otherwise it is the
     single tile. With splitting off, step 1's image is squashed to one tile.
Every tile gives `tokens_per_tile` image tokens (`image_seq_len`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MAX_IMAGE_SIZE", "Idefics3Layout", "idefics3_layout"]

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on the resized longest edge


@dataclass(frozen=True)
class Idefics3Layout:
    width: int
    height: int
    resized: tuple[int, int]  # (height, width) after the longest-edge resize (step 1)
    split_size: tuple[int, int]  # (height, width) of the image the tiles are cut from
    grid: tuple[int, int]  # (rows, cols); (0, 0) when the image is a single tile
    num_tiles: int  # rows * cols + 1 global, or 1
    num_tokens: int


def _longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    # scale below the 4096 upper bound
    aspect_ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect_ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect_ratio)
    return max(height, 1), max(width, 1)


def _multiple_of_tile_size(height: int, width: int, tile_size: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile_size) * tile_size
        height = math.ceil(int(width / aspect_ratio) / tile_size) * tile_size
    else:
        height = math.ceil(height / tile_size) * tile_size
        width = math.ceil(int(height * aspect_ratio) / tile_size) * tile_size
    return height, width


def idefics3_layout(
    width: int,
    height: int,
    *,
    longest_edge: int,
    tile_size: int,
    tokens_per_tile: int,
    do_image_splitting: bool = True,
) -> Idefics3Layout:
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    resized = _longest_edge_size(height, width, longest_edge)
    if not do_image_splitting:
        return Idefics3Layout(width, height, resized, (tile_size, tile_size), (0, 0), 1,
                              tokens_per_tile)  # fmt: skip
    split = _multiple_of_tile_size(*resized, tile_size)
    if split[0] > tile_size or split[1] > tile_size:
        rows, cols = split[0] // tile_size, split[1] // tile_size
        num_tiles = rows * cols + 1
    else:
        rows, cols, num_tiles = 0, 0, 1
    return Idefics3Layout(width, height, resized, split, (rows, cols), num_tiles,
                          num_tiles * tokens_per_tile)  # fmt: skip

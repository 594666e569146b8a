"""InternVL dynamic tiling as a layout: tiles and exact token count from (width, height).

The grid rule itself (`internvl_grid`) lives in `encoders.tiling.grid`; this module turns it
into the layout record the pipeline carries (header -> layout -> tiles -> tokens), the
same shape of record as `AnyresLayout` and `Idefics3Layout`:
  * the image is resized to (cols * tile_size, rows * tile_size) and cut row-major;
  * with more than one tile and `use_thumbnail`, the whole image squashed to one tile
    is appended LAST;
  * every tile gives `tokens_per_tile` tokens (the embedded model wraps them in
    `<img_start>` ... `<img_end>`, which are text, not image tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from encoders.tiling.grid import internvl_grid

__all__ = ["InternVLLayout", "internvl_layout"]


@dataclass(frozen=True)
class InternVLLayout:
    """Where an image's pixels go and how many tokens they become."""

    width: int
    height: int
    resized: tuple[int, int]  # (height, width) of the image the grid tiles are cut from
    grid: tuple[int, int]  # (rows, cols)
    num_tiles: int  # rows * cols, plus the thumbnail when that is more than one
    num_tokens: int
    has_thumbnail: bool


def internvl_layout(
    width: int,
    height: int,
    *,
    tile_size: int,
    tokens_per_tile: int,
    min_num_tiles: int = 1,
    max_num_tiles: int = 12,
    use_thumbnail: bool = True,
) -> InternVLLayout:
    """The InternVL layout of a width x height image (its header size suffices)."""
    if tokens_per_tile < 1:
        raise ValueError(f"tokens_per_tile={tokens_per_tile} must be positive")
    cols, rows = internvl_grid(
        width, height, image_size=tile_size, min_num=min_num_tiles, max_num=max_num_tiles
    )
    has_thumbnail = use_thumbnail and rows * cols > 1
    num_tiles = rows * cols + int(has_thumbnail)
    return InternVLLayout(width, height, (rows * tile_size, cols * tile_size), (rows, cols),
                          num_tiles, num_tiles * tokens_per_tile, has_thumbnail)  # fmt: skip

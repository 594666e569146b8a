"""Aspect-ratio tiling rules: how many tiles an image of a given size becomes.

Pure functions of (width, height): the visual-token count of an image is known from its
header alone, before any pixel is decoded (admission relies on it). Each model family's
rule lives here as its own small set of functions.

InternVL dynamic tiling (InternVL 1.5+ `dynamic_preprocess`):
  * candidate grids are (cols, rows) with min_num <= cols * rows <= max_num;
  * the grid whose aspect ratio cols / rows is closest to width / height wins; on a tie the
    later (larger) grid wins only if the image area exceeds half the grid's pixel area,
    `width * height > 0.5 * image_size**2 * cols * rows`;
  * the image is resized to (cols * image_size, rows * image_size) and cut into tiles in
    row-major order; when there is more than one tile a global thumbnail (the whole image
    resized to image_size × image_size) is appended LAST.
"""

from __future__ import annotations

from functools import lru_cache

Grid = tuple[int, int]  # (cols, rows)


@lru_cache(maxsize=64)
def internvl_candidate_grids(min_num: int, max_num: int) -> tuple[Grid, ...]:
    """Candidate (cols, rows) grids in InternVL's order (ascending tile count)."""
    if min_num < 1 or max_num < min_num:
        raise ValueError(f"need 1 <= min_num <= max_num, got min_num={min_num} max_num={max_num}")
    # Built exactly as InternVL does (a set, then a stable sort on the product) so that the
    # order among grids with equal tile counts, which decides some ties, is the same.
    grids = {
        (i, j)
        for n in range(min_num, max_num + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_num <= i * j <= max_num
    }
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def internvl_grid(
    width: int, height: int, *, image_size: int, min_num: int = 1, max_num: int = 12
) -> Grid:
    """The (cols, rows) grid InternVL's dynamic tiling picks for a width × height image."""
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if image_size < 1:
        raise ValueError(f"image_size must be positive, got {image_size}")
    aspect_ratio = width / height
    area = width * height
    best_diff = float("inf")
    best: Grid = (1, 1)
    for cols, rows in internvl_candidate_grids(min_num, max_num):
        diff = abs(aspect_ratio - cols / rows)
        if diff < best_diff:
            best_diff = diff
            best = (cols, rows)
        elif diff == best_diff and area > 0.5 * image_size * image_size * cols * rows:
            best = (cols, rows)
    return best


def internvl_num_tiles(
    width: int,
    height: int,
    *,
    image_size: int,
    min_num: int = 1,
    max_num: int = 12,
    use_thumbnail: bool = True,
) -> int:
    """Tiles the image becomes: cols * rows, plus the thumbnail when that is more than one."""
    cols, rows = internvl_grid(
        width, height, image_size=image_size, min_num=min_num, max_num=max_num
    )
    num_tiles = cols * rows
    return num_tiles + 1 if use_thumbnail and num_tiles > 1 else num_tiles


def internvl_tile_boxes(grid: Grid, *, image_size: int) -> list[tuple[int, int, int, int]]:
    """(left, top, right, bottom) crop boxes, row-major, in the image resized to the grid."""
    cols, rows = grid
    return [
        (c * image_size, r * image_size, (c + 1) * image_size, (r + 1) * image_size)
        for r in range(rows)
        for c in range(cols)
    ]

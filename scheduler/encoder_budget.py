"""The per-step encoder budget: how many vision-tower tiles a prefill chunk runs, and where
to cut it so a step stays within `encoder_tiles_per_step` (article §17: one huge image must
not stall every decode for a whole step).

The runner encodes an image whole in the first chunk that reaches one of its placeholder
positions and keeps its embeddings until the chunk that reaches its last one. So a chunk
[start, end) runs the tower for the images it reaches that no earlier chunk of the same
admission (which began at `admitted_at`) reached, and that the encoder cache does not
hold. Pure functions: no state, no device.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from scheduler.sequence import ImagePlaceholder


def image_tiles(image: ImagePlaceholder) -> int:
    """Tiles the tower runs for `image` (unknown counts as one)."""
    return max(1, image.num_tiles)


def needs_tower(
    image: ImagePlaceholder, start: int, end: int, admitted_at: int, cached: bool
) -> bool:
    """Whether the chunk [start, end) of an admission begun at `admitted_at` encodes it."""
    positions = image.positions
    if cached or not positions or positions[-1] < start or positions[0] >= end:
        return False
    first_here = bisect_left(positions, start)
    if first_here == len(positions) or positions[first_here] >= end:
        return False  # the chunk falls between two of its positions
    first_since_admission = bisect_left(positions, admitted_at)
    return not positions[first_since_admission] < start  # reached by an earlier chunk


def cut_chunk(
    images: list[ImagePlaceholder],
    start: int,
    end: int,
    admitted_at: int,
    is_cached: Callable[[ImagePlaceholder], bool],
    tiles_used: int,
    budget: int | None,
) -> tuple[int, int]:
    """(new end, tiles encoded) for the chunk [start, end) when `tiles_used` tiles are
    already spent this step: the chunk stops before the first image that would pass the
    budget, unless nothing has been encoded this step yet (one image larger than the
    whole budget then goes alone). The new end may equal `start` (nothing fits)."""
    tiles = 0
    for image in sorted(images, key=lambda i: i.positions[0] if i.positions else -1):
        if not needs_tower(image, start, end, admitted_at, is_cached(image)):
            continue
        n = image_tiles(image)
        if budget is not None and tiles_used + tiles + n > budget and tiles_used + tiles > 0:
            return max(start, image.positions[bisect_left(image.positions, start)]), tiles
        tiles += n
    return end, tiles

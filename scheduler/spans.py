"""Bidirectional spans (Gemma 3: an image's tokens attend to each other in full during
prefill): where a prefill chunk may end and how much of a cached prefix may be reused.

Invariant the planner keeps: a chunk never ends strictly inside a span, so every query
of a span sees all of its keys in the same step (the attention kernels take a span as
lying inside its chunk), and a prefix-cache match never ends inside one (the rest of a
partly cached image would start a chunk inside its span). Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

Span = tuple[int, int]  # [start, end) positions


class Placed(Protocol):
    """An image's placeholders (a prompt's `ImagePlaceholder`, a chunk's `ImageChunk`)."""

    positions: Seq[int]


def image_spans(images: Seq[Placed]) -> tuple[Span, ...]:
    """The runs of consecutive placeholder positions, in order: one per image, or per
    pan-and-scan crop (their runs are separated by text tokens)."""
    runs: list[Span] = []
    for pos in sorted(p for image in images for p in image.positions):
        if runs and runs[-1][1] == pos:
            runs[-1] = (runs[-1][0], pos + 1)
        else:
            runs.append((pos, pos + 1))
    return tuple(runs)


def span_safe_end(spans: Seq[Span], start: int, end: int) -> int:
    """The end of the chunk [start, end) moved off any span it would cut: back to the
    span's start, or, when the chunk begins at that span (it cannot fit whole in the
    room left), on to its end: one image may take a step past its token budget, never a
    half image."""
    for span_start, span_end in spans:
        if span_start < end < span_end:
            return span_start if span_start > start else span_end
    return end


def span_safe_prefix(spans: Seq[Span], num_cached: int) -> int:
    """Cached tokens that may be reused: `num_cached`, or the start of the span it ends
    inside (the caller rounds down to whole blocks)."""
    for span_start, span_end in spans:
        if span_start < num_cached < span_end:
            return span_start
    return num_cached

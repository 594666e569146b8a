"""The StepPlan: the one record that crosses from the scheduler to the runner each step.

Self-contained, like vLLM v1's `SchedulerOutput`: request ids, the tokens and positions to
compute, the block-table change since the runner last saw the request (one per KV cache
group), the image placeholders the chunk fills (the encoder work of the step, named by
request id, image index and encoder-cache key), drafts, whether a row samples, and the
requests that finished or lost their KV since the plan before. The runner keeps its own
block tables and the encoder records of each request's images (encoders/stage.py makes
them) and applies the plan to them; it never reads a `Sequence`. The scheduler keeps the
live sequences and looks them up by request id when the step comes back.

What must stay true: a plan holds plain data only (ints, strings, bytes, tuples, lists,
frozen records of those); tests/scheduler/test_step_plan.py walks it.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from dataclasses import dataclass

from scheduler.sequence import Sequence


@dataclass(frozen=True)
class BlockTableDelta:
    """The runner's copy of a block table becomes `table[:num_kept] + new_block_ids`."""

    num_kept: int
    new_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ImageChunk:
    """The placeholders of one image that a chunk covers: embeddings
    [offset_start, offset_start + len(positions)) of the image go to `positions`."""

    index: int  # the image's index in its request: the runner's record of it
    cache_key: bytes  # ImagePlaceholder.content_hash (a pool image's encoder-cache key)
    num_tokens: int  # embeddings the whole image yields
    offset_start: int
    positions: tuple[int, ...]  # absolute prompt positions, inside the chunk
    is_last: bool  # the chunk holds the image's last placeholder


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: query rows for positions
    [num_computed_tokens, num_computed_tokens + num_new_tokens)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    sample: bool  # the chunk reaches the last token, so a next token is sampled
    # Known ids of the rows, in order. Async scheduling: a decode whose input token is
    # still being sampled by the step in flight has one row fewer here; the runner takes
    # that token from the step's output. Drafts fill the last rows and are not here.
    token_ids: tuple[int, ...] = ()
    # Guessed tokens after the last one: they fill the last len(drafts) query rows and
    # join the sequence only once accepted. Non-empty only for a sampling decode.
    draft_token_ids: tuple[int, ...] = ()
    block_table: BlockTableDelta = BlockTableDelta(0)
    images: tuple[ImageChunk, ...] = ()
    # Hybrid KV: the deltas of KV cache groups 1.. (`block_table` is group 0's).
    group_block_tables: tuple[BlockTableDelta, ...] = ()

    @property
    def end(self) -> int:
        """Where the request's KV ends once the step has run (drafts included)."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass(frozen=True)
class StepPlan:
    scheduled: list[ScheduledSeq]
    preempted: tuple[str, ...] = ()  # request ids that lost their KV this step
    # Request ids finished (done, aborted, failed) since the plan before: the runner
    # forgets them. A request added again under such an id meanwhile is not here.
    finished: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def without(self, request_ids: set[str]) -> StepPlan:
        """This plan without the items of `request_ids` (failed meanwhile)."""
        kept = [item for item in self.scheduled if item.request_id not in request_ids]
        return dataclasses.replace(self, scheduled=kept) if request_ids else self


def schedule_item(
    seq: Sequence, num_new: int, sample: bool, drafts: tuple[int, ...] = ()
) -> ScheduledSeq:
    """The record of `seq`'s rows this step (its blocks already grown). Marks the block
    table synced: the runner holds it once it has applied this delta."""
    start = seq.num_computed_tokens
    end = start + num_new
    synced = seq.num_synced_blocks
    delta = BlockTableDelta(synced, tuple(seq.block_table[synced:]))
    seq.num_synced_blocks = len(seq.block_table)
    group_deltas: tuple[BlockTableDelta, ...] = ()
    if seq.group_block_tables:  # hybrid KV
        group_deltas = tuple(_group_deltas(seq))
    return ScheduledSeq(
        seq.request_id, start, num_new, sample, tuple(seq.token_ids[start:end]), drafts, delta,
        image_chunks(seq, start, end) if seq.images else (), group_deltas,
    )  # fmt: skip


def _group_deltas(seq: Sequence) -> list[BlockTableDelta]:
    """The deltas of KV cache groups 1..; marks them synced."""
    deltas = []
    for group, table in enumerate(seq.group_block_tables):
        synced = seq.num_synced_group_blocks[group]
        deltas.append(BlockTableDelta(synced, tuple(table[synced:])))
        seq.num_synced_group_blocks[group] = len(table)
    return deltas


def image_chunks(seq: Sequence, start: int, end: int) -> tuple[ImageChunk, ...]:
    """The images whose placeholders fall in positions [start, end)."""
    chunks = []
    for index, image in enumerate(seq.images):
        positions = image.positions
        if not positions or positions[-1] < start or positions[0] >= end:
            continue
        lo, hi = bisect_left(positions, start), bisect_left(positions, end)
        if lo < hi:
            chunks.append(
                ImageChunk(
                    index, image.content_hash, image.num_tokens, lo, tuple(positions[lo:hi]),
                    hi == len(positions),
                )
            )  # fmt: skip
    return tuple(chunks)

"""Bidirectional spans (Gemma 3 images): the pure rules, and the planner's invariant under a
random run: no chunk starts or ends strictly inside a span, through chunking, the lump cap,
preemptions and prefix-cache hits."""

from __future__ import annotations

import random

from sched_testing import make_scheduler

from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.spans import image_spans, span_safe_end, span_safe_prefix


def test_runs_of_placeholders_are_the_spans():
    images = [ImagePlaceholder(b"a", [3, 4, 5, 8, 9]), ImagePlaceholder(b"b", [10, 11, 20])]
    assert image_spans(images) == ((3, 6), (8, 12), (20, 21))


def test_a_chunk_end_moves_off_a_span():
    spans = [(10, 20), (30, 40)]
    assert span_safe_end(spans, 0, 15) == 10  # back to the span's start
    assert span_safe_end(spans, 10, 15) == 20  # the chunk starts at it: the whole span
    assert span_safe_end(spans, 0, 20) == 20  # at its end: fine
    assert span_safe_end(spans, 20, 25) == 25
    assert span_safe_prefix(spans, 16) == 10
    assert span_safe_prefix(spans, 20) == 20


def _request(rid: str, rng: random.Random, prefix: list[int], image_hash: bytes) -> Sequence:
    """A shared text prefix, one shared image (a prefix hit for the next one), then a few
    more images of its own and a question."""
    tokens, images, pos = list(prefix), [], len(prefix)
    for i in range(rng.randint(1, 3)):
        n = 16 if i == 0 else rng.choice([8, 16, 24])
        key = image_hash if i == 0 else f"{rid}/{i}".encode()
        tokens += [1] * n  # the placeholder id
        images.append(ImagePlaceholder(key, list(range(pos, pos + n)), num_tiles=1))
        pos += n
        gap = rng.randint(1, 6)
        tokens += [rng.randrange(100, 200) for _ in range(gap)]
        pos += gap
    seq = Sequence(rid, tokens, images)
    seq.spans = image_spans(images)
    return seq


def test_random_run_never_cuts_a_span():  # noqa: PLR0915
    rng = random.Random(5)
    hits = 0
    for trial in range(6):
        scheduler = make_scheduler(
            num_blocks=rng.choice([40, 60, 200]), block_size=4,
            max_num_batched_tokens=rng.choice([12, 20, 48]),
            lump_prefill_tokens_per_step=rng.choice([None, 10]),
            admission=rng.choice(["fcfs", "lumpy"]),
        )  # fmt: skip
        prefix = [rng.randrange(100, 200) for _ in range(rng.randint(0, 9))]
        seqs, limits = {}, {}
        for i in range(8):
            seq = _request(f"t{trial}r{i}", rng, prefix, b"shared")
            seqs[seq.request_id] = seq
            limits[seq.request_id] = seq.num_tokens + rng.randint(1, 6)
            scheduler.add(seq, limits[seq.request_id])
        for _ in range(500):
            if not scheduler.has_unfinished():
                break
            plan = scheduler.schedule()
            for item in plan.scheduled:
                for start, end in seqs[item.request_id].spans:
                    assert not start < item.num_computed_tokens < end, (item, start, end)
                    assert not start < item.end < end, (item, start, end)
            scheduler.update(plan, [[7] if item.sample else [] for item in plan.scheduled])
            for item in plan.scheduled:
                seq = scheduler.seqs[item.request_id]
                if seq.num_tokens >= limits[seq.request_id]:
                    scheduler.finish(seq)
            scheduler.block_manager.check_integrity()
        assert not scheduler.has_unfinished(), "the run did not drain"
        bm = scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        hits += sum(s.num_cached_tokens > 0 for s in seqs.values())
    assert hits > 0, "the run was meant to reuse cached prefixes"

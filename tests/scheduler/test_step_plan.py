"""The StepPlan contract: a runner that keeps only what plans tell it (block-table deltas,
token ids, image chunks) always holds the scheduler's truth, through prefix-cache hits,
speculative rollbacks and preemptions; and a plan holds no live scheduler object."""

from __future__ import annotations

import dataclasses
import random

from sched_testing import make_request, make_scheduler

from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from scheduler.planner import Scheduler
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.step_plan import StepPlan, image_chunks


class RunnerCopy:
    """The runner's side of the contract, as vlmserve/worker/runner.py keeps it."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan) -> None:
        for request_id in plan.preempted:
            self.tables.pop(request_id, None)
        for item in plan.scheduled:
            table = self.tables.setdefault(item.request_id, [])
            del table[item.block_table.num_kept :]
            table.extend(item.block_table.new_block_ids)


def live_objects(value: object) -> list[object]:
    """Scheduler objects reachable from `value` through dataclasses and containers."""
    if isinstance(value, Sequence | ImagePlaceholder | Scheduler):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [x for f in dataclasses.fields(value) for x in live_objects(getattr(value, f.name))]
    if isinstance(value, list | tuple):
        return [x for v in value for x in live_objects(v)]
    return []


def test_the_runner_copy_of_every_block_table_follows_the_deltas():
    rng = random.Random(0)
    spec = SpeculativeConfig(num_speculative_tokens=3, adaptive=False)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=24, admission="fcfs"),
        CacheConfig(block_size=4), num_blocks=16, speculative=spec,
    )  # fmt: skip
    runner, limits = RunnerCopy(), {}
    seen = {"preempted": 0, "rolled_back": 0, "prefix_hits": 0}
    for step in range(400):
        if step < 300 and rng.random() < 0.4:
            # Repetitive prompts: n-gram drafts, and shared prefixes between requests.
            prompt = [1 + (i % 3) for i in range(rng.randrange(5, 30))]
            seq = Sequence(f"r{step}", prompt)
            limits[seq.request_id] = len(prompt) + rng.randrange(1, 20)
            scheduler.add(seq, limits[seq.request_id])
        plan = scheduler.schedule()
        assert live_objects(plan) == []
        runner.apply(plan)
        seen["preempted"] += len(plan.preempted)
        for item in plan.scheduled:
            seq = scheduler.seqs[item.request_id]
            assert runner.tables[item.request_id] == seq.block_table
            assert item.num_computed_tokens == seq.num_computed_tokens
            assert list(item.token_ids) == seq.token_ids[item.num_computed_tokens : item.end]
        sampled = []
        for item in plan.scheduled:
            drafts = item.draft_token_ids
            keep = rng.randrange(len(drafts) + 1) if drafts else 0
            seen["rolled_back"] += keep < len(drafts)
            sampled.append([*drafts[:keep], rng.choice([1, 2, 3])] if item.sample else [])
        scheduler.update(plan, sampled)
        for item in plan.scheduled:
            seq = scheduler.seqs[item.request_id]
            if seq.num_tokens >= limits[seq.request_id]:
                seen["prefix_hits"] += seq.num_cached_tokens > 0
                scheduler.finish(seq)
                runner.tables.pop(seq.request_id)
        scheduler.block_manager.check_integrity()
    assert not scheduler.has_unfinished()
    assert all(count > 0 for count in seen.values()), seen  # each path was exercised


def test_image_chunks_cover_each_placeholder_once_in_order():
    scheduler = make_scheduler(max_num_batched_tokens=7)
    seq = make_request("img", 40, images=[(3, 10, 1), (20, 12, 1)])
    scheduler.add(seq, 41)
    filled: dict[int, list[tuple[int, int]]] = {0: [], 1: []}  # image -> (offset, position)
    last: list[int] = []
    while seq.num_computed_tokens < 40:
        plan = scheduler.schedule()
        [item] = plan.scheduled
        for chunk in item.images:
            assert all(item.num_computed_tokens <= p < item.end for p in chunk.positions)
            offsets = range(chunk.offset_start, chunk.offset_start + len(chunk.positions))
            filled[chunk.index] += list(zip(offsets, chunk.positions, strict=True))
            if chunk.is_last:
                last.append(chunk.index)
        scheduler.update(plan, [[7] if item.sample else [] for item in plan.scheduled])
    for index, image in enumerate(seq.images):
        assert filled[index] == list(enumerate(image.positions))
    assert last == [0, 1]


def test_image_chunks_of_a_chunk_that_holds_no_placeholder_are_empty():
    seq = make_request("img", 40, images=[(3, 10, 1)])
    assert image_chunks(seq, 13, 40) == ()
    [chunk] = image_chunks(seq, 0, 5)
    assert (chunk.offset_start, chunk.positions, chunk.is_last) == (0, (3, 4), False)

"""The StepPlan contract: a runner that keeps only what plans tell it (block-table deltas,
token ids, image chunks, finished and preempted ids) always holds the scheduler's truth,
through prefix-cache hits, speculative rollbacks, preemptions and finishes; and a plan
holds plain data only."""

from __future__ import annotations

import dataclasses
import random

import pytest
from sched_testing import make_request, make_scheduler

from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig, group_peak_blocks
from scheduler.planner import Scheduler
from scheduler.sequence import Sequence
from scheduler.step_plan import StepPlan, image_chunks


class RunnerCopy:
    """The runner's side of the contract, as vlmserve/worker/runner.py keeps it (group 0's
    table in `tables`, KV cache groups 1.. in `group_tables`)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.group_tables: dict[str, list[list[int]]] = {}

    def apply(self, plan: StepPlan) -> None:
        for request_id in plan.finished + plan.preempted:
            self.tables.pop(request_id, None)
            self.group_tables.pop(request_id, None)
        for item in plan.scheduled:
            deltas = (item.block_table, *item.group_block_tables)
            tables = [self.tables.setdefault(item.request_id, [])]
            tables += self.group_tables.setdefault(item.request_id, [[] for _ in deltas[1:]])
            for table, delta in zip(tables, deltas, strict=True):
                del table[delta.num_kept :]
                table.extend(delta.new_block_ids)


PLAIN = (int, float, str, bytes, bool, type(None))


def not_plain(value: object, path: str = "plan") -> list[str]:
    """Where `value` holds anything but plain data: ints, floats, strings, bytes, bools,
    None, and tuples, lists, dicts and frozen dataclasses of those."""
    if isinstance(value, PLAIN):
        return []
    if isinstance(value, list | tuple):
        return [x for i, v in enumerate(value) for x in not_plain(v, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [
            x for k, v in value.items() for x in not_plain(k, path) + not_plain(v, f"{path}[{k!r}]")
        ]
    is_record = dataclasses.is_dataclass(value) and not isinstance(value, type)
    if is_record and type(value).__dataclass_params__.frozen:
        return [
            x
            for f in dataclasses.fields(value)
            for x in not_plain(getattr(value, f.name), f"{path}.{f.name}")
        ]
    return [f"{path}: {type(value).__name__}"]


def test_the_plain_data_check_finds_a_live_object():
    seq = make_request("img", 20, images=[(3, 10, 1)])
    [chunk] = image_chunks(seq, 0, 20)
    assert not_plain(StepPlan([], ("a",), ("b",))) == []
    assert not_plain(dataclasses.replace(chunk, cache_key=seq)) == ["plan.cache_key: Sequence"]
    assert not_plain({"x": [1, (2, object())]}) == ["plan['x'][1][1]: object"]
    assert not_plain(Sequence("a", [1])) == ["plan: Sequence"]  # a mutable dataclass


def test_the_runner_copy_of_every_block_table_follows_the_deltas():
    rng = random.Random(0)
    spec = SpeculativeConfig(num_speculative_tokens=3, adaptive=False)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=24, admission="fcfs"),
        CacheConfig(block_size=4), num_blocks=16, speculative=spec,
    )  # fmt: skip
    runner, limits, finished = RunnerCopy(), {}, []
    seen = {"preempted": 0, "rolled_back": 0, "prefix_hits": 0}
    for step in range(400):
        if step < 300 and rng.random() < 0.4:
            # Repetitive prompts: n-gram drafts, and shared prefixes between requests.
            prompt = [1 + (i % 3) for i in range(rng.randrange(5, 30))]
            seq = Sequence(f"r{step}", prompt)
            limits[seq.request_id] = len(prompt) + rng.randrange(1, 20)
            scheduler.add(seq, limits[seq.request_id])
        plan = scheduler.schedule()
        assert not_plain(plan) == []
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
                finished.append(seq.request_id)
        scheduler.block_manager.check_integrity()
    assert not scheduler.has_unfinished()
    runner.apply(scheduler.schedule())  # the last finished ones reach the runner
    assert runner.tables == {} and sorted(finished) == sorted(set(finished))
    assert all(count > 0 for count in seen.values()), seen  # each path was exercised


@pytest.mark.parametrize("admission", ["fcfs", "lumpy"])
def test_hybrid_tables_follow_the_deltas_and_drop_what_leaves_the_window(admission):
    """A full group and two sliding groups (window 9) in one pool, under a random run with
    prefix hits, speculation and preemptions: the runner's copies of every group's tables
    follow the deltas; before a sequence's step its sliding tables hold the null block
    exactly where blocks lie wholly before the window of its first query, and never more
    than the window and one step; the pool's invariants hold after every step."""
    rng = random.Random(1)
    window, budget = 9, 16
    spec = SpeculativeConfig(num_speculative_tokens=2, adaptive=False)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, admission=admission, max_num_seqs=6),
        CacheConfig(block_size=4), num_blocks=48, speculative=spec,
        kv_windows=(None, window, window),
    )  # fmt: skip
    bm = scheduler.block_manager
    runner, limits = RunnerCopy(), {}
    seen = {"preempted": 0, "prefix_hits": 0, "released": 0, "sliding_hits": 0}
    for step in range(800):
        if step < 300 and rng.random() < 0.25:
            prompt = [1 + (i % 5) for i in range(rng.randrange(5, 45))]
            seq = Sequence(f"r{step}", prompt)
            limits[seq.request_id] = len(prompt) + rng.randrange(1, 30)
            if scheduler.check_fits(len(prompt), limits[seq.request_id] - len(prompt)) is None:
                scheduler.add(seq, limits[seq.request_id])
        plan = scheduler.schedule()
        runner.apply(plan)
        seen["preempted"] += len(plan.preempted)
        for item in plan.scheduled:
            seq = scheduler.seqs[item.request_id]
            assert runner.tables[item.request_id] == seq.block_table
            assert runner.group_tables[item.request_id] == seq.group_block_tables
            skipped = max(0, item.num_computed_tokens - window + 1) // 4
            for table in seq.group_block_tables:
                assert table[:skipped] == [0] * skipped and 0 not in table[skipped:]
                held = len(table) - skipped
                assert held <= group_peak_blocks(window, 4, seq.num_tokens + 2, budget)
            seen["released"] += skipped > 0
            seen["sliding_hits"] += seq.num_cached_tokens >= 16 and skipped > 0
        sampled = []
        for item in plan.scheduled:
            drafts = item.draft_token_ids
            keep = rng.randrange(len(drafts) + 1) if drafts else 0
            sampled.append([*drafts[:keep], rng.choice([1, 2, 3])] if item.sample else [])
        scheduler.update(plan, sampled)
        for item in plan.scheduled:
            seq = scheduler.seqs[item.request_id]
            if seq.num_tokens >= limits[seq.request_id]:
                seen["prefix_hits"] += seq.num_cached_tokens > 0
                scheduler.finish(seq)
        bm.check_integrity()
    assert not scheduler.has_unfinished()
    assert bm.num_free_blocks == bm.num_usable_blocks
    if admission == "lumpy":  # its reservations cover each request's whole length here
        seen.pop("preempted")
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

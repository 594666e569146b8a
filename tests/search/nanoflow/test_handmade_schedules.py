"""Hand-made schedules: valid by the independent checker, NanoFlow's two published
pipeline shapes (the overlaps the reference describes), list scheduling's times."""

from __future__ import annotations

import pytest

from search.nanoflow.handmade_schedules import (
    four_two_schedule,
    list_schedule,
    sequential_schedule,
    two_way_schedule,
)
from search.nanoflow.schedule import Schedule, check


def duration(op: str, rows: int) -> float:
    return (4.0 if op == "attention" else 1.0) * rows


def during(schedule: Schedule, op: str, rows: tuple[int, int]) -> tuple[float, float]:
    [n] = [n for n in schedule.nano_ops if (n.op, n.row_start, n.row_end) == (op, *rows)]
    return n.start_us, n.start_us + n.duration_us


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_two_way_overlaps_attention_of_one_nano_batch_with_gemms_of_the_other():
    s = two_way_schedule("m", "cpu", 64, duration)
    assert check(s) == [] and s.is_split
    assert overlaps(during(s, "attention", (0, 32)), during(s, "qkv", (32, 64)))
    assert overlaps(during(s, "attention", (32, 64)), during(s, "gate_up", (0, 32)))
    assert {n.stream for n in s.nano_ops if n.op == "attention"} == {1}
    # Sequential: 9 ops at 64 rows (attention 4x), one after another.
    assert s.sequential_us == 8 * 64 + 4 * 64
    assert s.makespan_us < s.sequential_us


def test_four_two_cuts_the_attention_segment_four_ways_and_the_mlp_two():
    s = four_two_schedule("m", "cpu", 2048, duration)
    assert check(s) == []
    rows = {op: sorted((n.row_start, n.row_end) for n in s.nano_ops if n.op == op)
            for op in ("qkv", "attention", "gate_up")}  # fmt: skip
    assert rows["attention"] == rows["qkv"] == [(0, 768), (768, 1536), (1536, 1792),
                                                (1792, 2048)]  # fmt: skip
    assert rows["gate_up"] == [(0, 1536), (1536, 2048)]


def test_list_scheduling_starts_each_op_when_its_inputs_and_stream_are_free():
    layout = [
        [("input_norm", 0, 4), ("qkv", 0, 2), ("qkv", 2, 4), ("rope_kv_write", 0, 4)],
        [("attention", 0, 2), ("attention", 2, 4)],
    ]
    s = list_schedule("m", "cpu", 4, layout, duration)
    assert during(s, "qkv", (2, 4)) == (6.0, 8.0)
    assert during(s, "attention", (0, 2)) == (12.0, 20.0)  # after the rope of rows 0-4
    assert during(s, "attention", (2, 4)) == (20.0, 28.0)  # after its stream is free
    assert s.makespan_us == 28.0
    # o_proj before the rope on stream 0 waits on attention, which waits on that rope.
    stuck = [[("input_norm", 0, 4), ("qkv", 0, 4), ("o_proj", 0, 4), ("rope_kv_write", 0, 4)],
             [("attention", 0, 4)]]  # fmt: skip
    with pytest.raises(ValueError, match="deadlocks"):
        list_schedule("m", "cpu", 4, stuck, duration)


def test_the_sequential_schedule_is_not_split():
    s = sequential_schedule("m", "cpu", 16, duration)
    assert check(s) == [] and not s.is_split
    assert s.makespan_us == s.sequential_us

"""The adaptive lump budget (hysteresis), the TPOT guard's chunk sizing on a synthetic
step cost, and the slack order's aging bound (scheduler/lump_budget.py, step_room.py)."""

from __future__ import annotations

import pytest
from sched_testing import make_request, make_scheduler, run_step

from scheduler.config import CacheConfig, SchedulerConfig, SloConfig
from scheduler.lump_budget import (
    TPOT_MARGIN,
    LumpBudget,
    StepShape,
    add_shapes,
    chunk_shape,
    largest_chunk,
)
from scheduler.planner import Scheduler
from scheduler.step_room import PrefillTime, tpot_limit_s


def test_budget_is_whole_until_needed_then_capped_at_once_and_released_by_doubling():
    budget = LumpBudget(cap_tokens=8, cap_tiles=2, full_tokens=64, release_steps=2)
    assert budget.next_step(needed=False).tokens is None  # nothing ever needed the caps
    capped = budget.next_step(needed=True)
    assert (capped.tokens, capped.tiles, capped.capped) == (8, 2, True)
    # Two quiet steps hold the caps; then 16, 32 tokens (tiles alike), then the whole.
    seen = [budget.next_step(needed=False) for _ in range(5)]
    assert [(a.tokens, a.tiles) for a in seen] == [(8, 2), (8, 2), (16, 4), (32, 8), (None, None)]
    assert budget.next_step(needed=True).tokens == 8  # back within the step it is needed


def test_alternating_arrivals_keep_the_caps_on_without_flapping():
    budget = LumpBudget(cap_tokens=8, cap_tiles=2, full_tokens=64, release_steps=2)
    allowances = [budget.next_step(needed=step % 2 == 0) for step in range(40)]
    assert {(a.tokens, a.tiles) for a in allowances} == {(8, 2)}
    # Every third step: still never lifted (two quiet steps are not past the release).
    budget = LumpBudget(cap_tokens=8, cap_tiles=2, full_tokens=64, release_steps=2)
    assert {budget.next_step(needed=step % 3 == 0).tokens for step in range(40)} == {8}


def lump_and_text_steps(arrivals: set[int], num_steps: int = 12) -> list[dict[str, int]]:
    """A 400-token lump (a 1-tile image at 2-9), text requests added before the steps in
    `arrivals`; per step, request id -> tokens."""
    scheduler = make_scheduler(
        num_blocks=256, admission="lumpy", lump_prefill_tokens_per_step=8,
        max_num_batched_tokens=48, lump_yields_to_quick=False, lump_release_steps=2,
    )  # fmt: skip
    scheduler.add(make_request("lump", 400, images=[(2, 8, 1)]), 402)
    limits, steps = {"lump": 402}, []
    for step in range(num_steps):
        if step in arrivals:
            scheduler.add(make_request(f"t{step}", 4), 5)
            limits[f"t{step}"] = 5
        plan = run_step(scheduler, limits)
        steps.append({item.request_id: item.num_new_tokens for item in plan.scheduled})
    return steps


def test_the_lump_gets_the_whole_budget_with_no_quick_request_and_the_cap_when_one_comes():
    steps = lump_and_text_steps({3})
    assert [s["lump"] for s in steps[:3]] == [48, 48, 48]  # alone: the whole step
    assert steps[3] == {"lump": 8, "t3": 4}  # the arrival's own step: capped
    # t3 is done: two quiet steps at the cap, then 16, 32, the whole budget.
    assert [s["lump"] for s in steps[4:9]] == [8, 8, 16, 32, 48]


def test_a_stream_every_other_step_holds_the_cap_steady():
    steps = lump_and_text_steps(set(range(2, 40, 2)), num_steps=14)
    assert {s["lump"] for s in steps[2:]} == {8}


def synthetic_cost(shape: StepShape) -> float:
    """1 ms a step, 0.1 ms a sequence, 0.02 ms a dense row, 2 ms a tile."""
    rows = shape.num_prefill_tokens + shape.num_decode_rows
    return 1e-3 + 1e-4 * shape.num_seqs + 2e-5 * rows + 2e-3 * shape.num_tiles_encoded


def test_tpot_limit_is_the_least_any_decode_can_wait_for_its_mean_to_stay_in_target():
    now = 0.05
    banked = make_request("banked", 4)  # 10 tokens, first at 0.01: 0.9·4 ms·10 − 40 ms
    banked.token_ids += [7] * 10
    banked.num_computed_tokens = banked.num_tokens - 1
    banked.first_token_time = 0.01
    assert tpot_limit_s([banked], 0.004, lambda: now) == pytest.approx(0.036 - 0.04 + 0.0)
    banked.first_token_time = 0.02  # 30 ms for 9 gaps: 6 ms may pass before the 10th
    assert tpot_limit_s([banked], 0.004, lambda: now) == pytest.approx(0.006)
    fresh = make_request("fresh", 4)  # its first token only: the per-step limit
    fresh.token_ids += [7]
    fresh.num_computed_tokens = fresh.num_tokens - 1
    fresh.first_token_time = now
    assert tpot_limit_s([banked, fresh], 0.004, lambda: now) == pytest.approx(0.0036)
    fresh.first_token_time = None  # no clock reading: the per-step limit too
    assert tpot_limit_s([banked, fresh], 0.004, lambda: now) == pytest.approx(0.0036)
    prefill = make_request("prefill", 8)  # no output yet: not decoding
    assert tpot_limit_s([prefill], 0.004, lambda: now) is None
    assert tpot_limit_s([banked], None, lambda: now) is None


def test_prefill_time_prices_whole_budget_chunks_beside_the_decodes():
    # 12 decodes leave 500 rows of a 512-token step: 1,200 tokens are 500 + 500 + 200.
    prefill_time = PrefillTime(synthetic_cost, 512, 12, 3000)
    step = 1e-3 + 1e-4 * 13  # per step and per sequence (12 decodes and the prefill)
    expected = 2 * (step + 2e-5 * 512) + (step + 2e-5 * 212)
    assert prefill_time(100, 1200) == pytest.approx(expected)
    assert prefill_time(100, 0) == 0.0
    assert PrefillTime(None, 512, 12, 3000)(100, 1200) == 0.0  # no model: no estimate


def test_largest_chunk_is_the_biggest_that_fits_and_never_below_the_floor():
    def cut(n: int) -> tuple[int, int]:
        return n, 0

    assert largest_chunk(100, 8, cut, lambda n, t: n <= 37) == (37, 0)
    assert largest_chunk(100, 8, cut, lambda n, t: n <= 200) == (100, 0)
    assert largest_chunk(100, 8, cut, lambda n, t: False) == (8, 0)  # the floor stands


def test_tpot_guard_keeps_each_decodes_mean_under_target_and_lets_lumps_use_the_rest():
    """The clock advances by each step's cost. The guard keeps every decode's mean time per
    output token (since its first) within TPOT_MARGIN of the 4 ms target, the SLO's
    measure (but for a step at the lump's floor, paid back by the next); the lump runs
    above its 16-token cap while they decode and never takes the whole budget."""
    tpot = 0.004  # 4 ms: a step with decodes may carry ~100 prefill rows (and no tile)
    config = SchedulerConfig(
        max_num_batched_tokens=512, admission="lumpy", lump_prefill_tokens_per_step=16,
        lump_yields_to_quick=False, slo=SloConfig(ttft_s=10.0, tpot_s=tpot),
    )  # fmt: skip
    now = [0.0]
    scheduler = Scheduler(
        config, CacheConfig(block_size=4), 2048, step_cost=synthetic_cost, clock=lambda: now[0]
    )
    limits = {}
    for i in range(4):
        scheduler.add(make_request(f"t{i}", 6), 60)  # long decodes
        limits[f"t{i}"] = 60
    scheduler.add(make_request("lump", 1200, images=[(600, 8, 1)]), 1202)
    limits["lump"] = 1202
    lump_rows, guarded, emitted = [], 0, {}
    for _ in range(30):
        plan = scheduler.schedule()
        shape = StepShape(
            num_prefill_tokens=sum(i.num_new_tokens for i in plan.scheduled
                                   if i.num_new_tokens > 1),
            num_decode_rows=sum(1 for i in plan.scheduled if i.num_new_tokens == 1),
            num_tiles_encoded=sum(1 for i in plan.scheduled if i.request_id == "lump"
                                  and i.num_computed_tokens <= 600 < i.end),
            num_seqs=len(plan.scheduled),
        )  # fmt: skip
        rows = sum(i.num_new_tokens for i in plan.scheduled if i.request_id == "lump")
        rows = rows if rows > 1 else 0  # its decodes are not prefill
        if shape.num_decode_rows and rows > 16:  # above the cap: the guard's doing
            guarded += 1
        lump_rows.append(rows)
        now[0] += synthetic_cost(shape)
        scheduler.update(plan, [[7] if item.sample else [] for item in plan.scheduled])
        for item in plan.scheduled:
            if item.sample and item.request_id.startswith("t"):
                emitted.setdefault(item.request_id, []).append(now[0])
            seq = scheduler.seqs[item.request_id]
            if seq.num_tokens >= limits[seq.request_id]:
                scheduler.finish(seq)
    # Every prefix of a decode's output within the target, and within the margin at the
    # end: the step that runs the tile at the lump's floor (3.9 ms) goes past the margin,
    # and the next step pays it back.
    for times in emitted.values():
        means = [(times[n - 1] - times[0]) / (n - 1) for n in range(2, len(times) + 1)]
        assert max(means) <= tpot and means[-1] <= tpot * TPOT_MARGIN + 1e-12, means
    assert guarded >= 5, guarded
    assert max(lump_rows) < 512  # but never the whole budget: the decodes' TPOT bound it
    # The tile's chunk: 2 ms of tower leaves less for rows, but the floor (cap) stands
    # (the last chunk is what is left of the prompt).
    assert min([r for r in lump_rows if r][:-1]) >= 8


def test_slack_order_never_starves_a_lump_behind_a_stream_of_tighter_targets():
    """As the step-counted aging test (test_planner.py), under TTFT targets: text 0.05 s,
    images 0.2 s, a step every 0.01 s. A small text request arrives every step with less
    slack than the waiting image lump, which does not fit while they run. Without the
    head reservation the stream would starve it until its aging clock, which starts at its
    deadline (20 steps after it arrives), ran out. With it, once the lump has the least
    slack (15 steps in: 0.05 s left) it is the head: text that would hold its blocks past
    the 3 steps the running ones take to drain no longer starts, and it starts before its
    deadline whatever the aging bound."""

    def first_admitted(max_wait_steps: int, num_steps: int = 200) -> int | None:
        config = SchedulerConfig(
            max_num_batched_tokens=64, admission="lumpy", max_wait_steps=max_wait_steps,
            slo=SloConfig(ttft_s=0.05, image_ttft_s=0.2),
        )  # fmt: skip
        now = [0.0]
        scheduler = Scheduler(config, CacheConfig(block_size=4), 10, clock=lambda: now[0])
        big = make_request("big", 30, images=[(2, 24, 13)])
        limits = {"big": 31}
        for step in range(-4, num_steps):
            if step == 0:
                scheduler.add(big, 31)
            small = make_request(f"s{step}", 4)
            scheduler.add(small, 7)
            limits[small.request_id] = 7
            plan = run_step(scheduler, limits)
            now[0] += 0.01
            if any(item.request_id == big.request_id for item in plan.scheduled):
                return step
        return None

    for bound in (0, 5, 20, 10**9):
        admitted = first_admitted(bound)
        assert admitted is not None and admitted <= 15 + 3, (bound, admitted)


def test_slack_order_serves_least_slack_first_and_late_requests_last():
    config = SchedulerConfig(
        max_num_batched_tokens=9, admission="lumpy", slo=SloConfig(ttft_s=1.0, image_ttft_s=3.0)
    )
    now = [10.0]
    scheduler = Scheduler(config, CacheConfig(block_size=4), 64, clock=lambda: now[0])
    late = make_request("late", 8)  # arrived at 8.5: 1 s target missed by 0.5 s
    late.arrival_time = 8.5
    image = make_request("image", 8, images=[(2, 4, 1)])  # arrived at 8.0: 1 s of 3 left
    image.arrival_time = 8.0
    text = make_request("text", 8)  # arrived at 9.5: 0.5 s left
    text.arrival_time = 9.5
    for seq in (late, image, text):
        scheduler.add(seq, 9)
    order = []
    for _ in range(3):  # one 8-token prompt a step (decodes first, so 7 rows are left)
        plan = scheduler.schedule()
        order += [item.request_id for item in plan.scheduled if item.end == 8]
        scheduler.update(plan, [[7] if item.sample else [] for item in plan.scheduled])
    assert order == ["text", "image", "late"]


def test_slack_order_never_starves_text_behind_a_stream_of_image_lumps():
    """The other class: an image lump (8 of 10 blocks, 6 output tokens) arrives every
    step, far more than the pool serves, each with the same TTFT target as the text
    request that arrives at step 5: the lumps that arrived before it go first, each a head
    the text may not delay, and once it is late the lumps that can still make theirs do.
    The aging bound still holds: it starts by its deadline (30 steps) plus max_wait_steps
    plus the steps the lump running then takes to finish."""
    config = SchedulerConfig(
        max_num_batched_tokens=64, admission="lumpy", max_wait_steps=10,
        slo=SloConfig(ttft_s=0.3),
    )  # fmt: skip
    now = [0.0]
    scheduler = Scheduler(config, CacheConfig(block_size=4), 10, clock=lambda: now[0])
    limits, started = {}, []
    for step in range(100):
        lump = make_request(f"img{step}", 26, images=[(2, 20, 4)])
        limits[lump.request_id] = 32
        scheduler.add(lump, 32)
        if step == 5:
            scheduler.add(make_request("text", 4), 7)
            limits["text"] = 7
        plan = run_step(scheduler, limits)
        now[0] += 0.01
        started += [item.request_id for item in plan.scheduled if item.num_computed_tokens == 0]
        if "text" in started:
            break
    assert "text" in started and step <= 5 + 30 + 10 + 8, step


def test_a_quick_request_waiting_for_kv_does_not_keep_the_caps_on():
    """A lump (75 of 80 blocks) is prefilling when a text request arrives that does not fit
    the 5 blocks left: short steps would not start it sooner, so after the step that found
    it waiting for KV the caps are released as if no quick request were there (two quiet
    steps, then doubling), instead of holding the lump at 8 rows a step until it ends."""
    scheduler = make_scheduler(num_blocks=80, admission="lumpy", lump_prefill_tokens_per_step=8)
    lump = make_request("lump", 300, images=[(2, 200, 1)])
    limits = {"lump": 301, "text": 44}
    scheduler.add(lump, 301)
    run_step(scheduler, limits)  # nothing needed the caps: the whole budget
    scheduler.add(make_request("text", 40), 44)
    rows = []
    for _ in range(6):
        plan = run_step(scheduler, limits)
        rows += [i.num_new_tokens for i in plan.scheduled if i.request_id == "lump"]
        assert all(i.request_id != "text" for i in plan.scheduled)
    assert rows == [8, 8, 8, 16, 32, 64], rows


def start_steps(admission: str) -> dict[str, int]:
    """Held-out trace img30-lognormal-bursts/seed303's lost image request, in small: a
    lump prefills (4,000 tokens, 64 a step), an image request waits behind it, and a text
    request arrives after the image (so with more slack: one 4 s target for both, a step
    every 0.05 s). Per request, the step it starts in."""
    config = SchedulerConfig(
        max_num_batched_tokens=64, admission=admission, lump_prefill_tokens_per_step=8,
        slo=SloConfig(ttft_s=4.0), lump_release_steps=2,
    )  # fmt: skip
    now = [0.0]
    scheduler = Scheduler(config, CacheConfig(block_size=4), 2048, clock=lambda: now[0])
    arrivals = {
        0: make_request("lump", 4000, images=[(2, 8, 1)]),
        1: make_request("image", 40, images=[(2, 8, 1)]),
        2: make_request("text", 4),
    }
    limits, started = {}, {}
    for step in range(200):
        if step in arrivals:
            seq = arrivals[step]
            limits[seq.request_id] = seq.num_tokens + 2
            scheduler.add(seq, seq.num_tokens + 2)
        plan = run_step(scheduler, limits)
        now[0] += 0.05
        for item in plan.scheduled:
            started.setdefault(item.request_id, step)
        if len(started) == 3:
            return started
    raise AssertionError(f"not all started: {started}")


def test_the_caps_never_delay_a_lump_with_less_slack_than_the_quick_request():
    """The text request becomes urgent (half its target gone) while the lump still
    prefills and the image waits for room. The image has less slack and goes first in the
    slack order, and nobody passes an urgent head: capping the lump for the text request
    would hold back the lump and the image, and the text with them. The caps stay off, so
    each starts when FCFS starts it (steps 62 and 63); before this rule the image started
    at step 93 and the text at 82."""
    fcfs, lumpy = start_steps("fcfs"), start_steps("lumpy")
    assert lumpy["image"] <= fcfs["image"], (fcfs, lumpy)
    assert lumpy["text"] <= fcfs["text"], (fcfs, lumpy)


def test_shapes_count_a_sliding_window_as_the_simulator_does():
    """Window 1,024: a 700-row chunk after 600 tokens (crossing the window) and a decode
    at 5,001 tokens; each row of a sliding layer priced at min(context, window) keys."""
    chunk = chunk_shape(600, 700, 0, False, 1024)
    assert chunk == StepShape(700, 0, 700 * 1300, 1300, 0, 1, 1024, 700 * 1024)
    both = add_shapes(chunk, chunk_shape(5000, 1, 0, True, 1024))
    assert both == StepShape(700, 1, 700 * 1300 + 5001, 6301, 0, 2, 2048, 700 * 1024 + 1024)
    plain = add_shapes(chunk_shape(600, 700, 0, False), chunk_shape(5000, 1, 0, True))
    assert plain == both[:6] + (None, None)  # no window: nothing counted
    # The prefill estimate beside 12 decodes at 3,000 tokens: its shapes carry the window.
    shapes: list[StepShape] = []
    PrefillTime(lambda s: shapes.append(s) or 1.0, 512, 12, 36_000, 1024, 12 * 1024)(100, 600)
    assert shapes[-1] == StepShape(100, 12, 100 * 700 + 36_000, 36_700, 0, 13,
                                   700 + 12 * 1024, 100 * 700 + 12 * 1024)  # fmt: skip

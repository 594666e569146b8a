"""The step planner: readiness, the per-step encoder budget, the aging bound, the
cheapest-recompute victim, and a burst of image requests that must not thrash."""

from __future__ import annotations

from sched_testing import make_request, make_scheduler, run_step, tiles_encoded

from scheduler.encoder_budget import cut_chunk
from scheduler.step_plan import StepPlan


def test_not_ready_sequence_is_never_scheduled():
    scheduler = make_scheduler()
    waiting = make_request("img", 12, images=[(2, 8, 2)], ready=False)
    text = make_request("text", 6)
    scheduler.add(waiting, 14)
    scheduler.add(text, 8)
    for _ in range(3):
        plan = run_step(scheduler, {"img": 14, "text": 8})
        assert all(item.request_id != "img" for item in plan.scheduled)
    assert waiting.status == "waiting" and waiting.num_waiting_steps == 0  # not aging
    waiting.ready = True
    [item] = scheduler.schedule().scheduled
    assert item.request_id == "img" and item.num_new_tokens == 12


def test_encoder_budget_caps_the_tiles_of_every_step():
    # Budget 5 tiles: requests of 3, 3, 2 and a 9-tile image (over the budget on its own).
    # FCFS: under lumpy admission the budget is a cap lifted while no quick request needs
    # it (tests/scheduler/test_lump_budget.py).
    scheduler = make_scheduler(
        encoder_tiles_per_step=5, max_num_batched_tokens=256, admission="fcfs"
    )
    specs = {"a": 3, "b": 3, "c": 2, "huge": 9, "d": 1}
    limits = {}
    for rid, tiles in specs.items():
        scheduler.add(make_request(rid, 12, images=[(2, 8, tiles)]), 14)
        limits[rid] = 14
    per_step = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        per_step.append(tiles_encoded(scheduler, plan))
        scheduler.update(plan, [[7] if item.sample else [] for item in plan.scheduled])
        for item in plan.scheduled:
            seq = scheduler.seqs[item.request_id]
            if seq.num_tokens >= limits[seq.request_id]:
                scheduler.finish(seq)
    # a (3) + c (2) = 5 first (b's chunk stops before its image: quick-first does not
    # apply, none is cached), then b (3) + d (1), then the huge one alone.
    assert [t for t in per_step if t] == [5, 4, 9]
    assert max(t for t in per_step if t != 9) <= 5


def test_cut_chunk_stops_before_the_image_that_passes_the_budget():
    a = make_request("x", 30, images=[(2, 4, 2), (10, 4, 3), (20, 4, 1)]).images
    never = lambda image: False  # noqa: E731
    assert cut_chunk(a, 0, 30, 0, never, 0, 5) == (20, 5)  # third would make 6
    assert cut_chunk(a, 0, 30, 0, never, 4, 5) == (2, 0)  # 4 spent: not even the first
    assert cut_chunk(a, 0, 30, 0, never, 0, 1) == (10, 2)  # the first goes alone
    assert cut_chunk(a, 12, 30, 0, never, 0, 1) == (30, 1)  # image 2 began earlier: free
    assert cut_chunk(a, 0, 30, 0, lambda image: True, 0, 1) == (30, 0)  # all cached


def test_aging_bound_holds_against_an_endless_stream_of_small_requests():
    """A new small text request arrives every step and lives 3 steps holding 2 of the 10
    blocks, so about 3 run at once and 4 blocks are free. A cold image request needing 8
    blocks arrives once the stream runs. Quick requests go first and it does not fit,
    so without aging it never starts; with max_wait_steps=W it starts within W steps plus
    the 3 the small ones already running take to drain."""

    def first_admitted(max_wait_steps: int, num_steps: int = 120) -> int | None:
        scheduler = make_scheduler(num_blocks=10, max_wait_steps=max_wait_steps)
        big = make_request("big", 30, images=[(2, 24, 13)])
        limits = {"big": 31}
        for step in range(-4, num_steps):
            if step == 0:
                scheduler.add(big, 31)
            small = make_request(f"s{step}", 4)
            scheduler.add(small, 7)
            limits[small.request_id] = 7
            plan = run_step(scheduler, limits)
            if any(item.request_id == big.request_id for item in plan.scheduled):
                return step
        return None

    assert first_admitted(max_wait_steps=10**9) is None
    for bound in (0, 5, 20):
        admitted = first_admitted(bound)
        assert admitted is not None and bound <= admitted <= bound + 3, (bound, admitted)
        assert admitted == bound + 1  # here the running small ones drain in one step


def test_preemption_takes_the_cheapest_victim_not_the_newest():
    """A (8 prompt tokens), B (4), C (11), arrived in that order, fill 6 blocks of 4. At
    the first decode A needs a third block. FCFS takes the newest, C, throwing away 11
    computed tokens; lumpy takes B, which has computed only 4."""

    def preempt(admission: str):
        scheduler = make_scheduler(num_blocks=6, admission=admission, decode_reserve_tokens=0)
        seqs = [make_request("A", 8), make_request("B", 4), make_request("C", 11)]
        limits = {s.request_id: 20 for s in seqs}
        for s in seqs:
            scheduler.add(s, 20)
        first = run_step(scheduler, limits)
        assert [item.request_id for item in first.scheduled] == ["A", "B", "C"]
        plan = run_step(scheduler, limits)
        return list(plan.preempted), scheduler.num_recomputed_tokens

    assert preempt("fcfs") == (["C"], 11)
    assert preempt("lumpy") == (["B"], 4)


def test_recompute_cost_leaves_out_blocks_shared_with_a_live_sequence():
    scheduler = make_scheduler(num_blocks=16)
    first = make_request("first", 9)
    second = make_request("second", 9)
    second.token_ids[:8] = first.token_ids[:8]  # two shared full blocks
    scheduler.add(first, 20)
    run_step(scheduler, {"first": 20})
    scheduler.add(second, 20)
    run_step(scheduler, {"first": 20, "second": 20})
    assert second.num_cached_tokens == 8
    assert scheduler.recompute_cost(first) == first.num_computed_tokens - 8
    assert scheduler.recompute_cost(second) == second.num_computed_tokens - 8


def burst(admission: str) -> tuple[int, int]:
    """8 image requests (24-token prompts with a 16-token image, 8 output tokens) into a
    pool of 20 blocks of 4 tokens (80 tokens: room for 2.5 whole requests)."""
    scheduler = make_scheduler(num_blocks=20, admission=admission, max_num_batched_tokens=32)
    limits = {}
    for i in range(8):
        scheduler.add(make_request(f"r{i}", 24, images=[(4, 16, 4)]), 32)
        limits[f"r{i}"] = 32
    steps = 0
    while scheduler.has_unfinished():
        run_step(scheduler, limits)
        steps += 1
        assert steps < 500, "the burst never drained"
    assert scheduler.block_manager.num_free_blocks == 20
    return scheduler.num_preemptions, scheduler.num_recomputed_tokens


def test_a_burst_of_image_requests_does_not_thrash():
    # Lumpy reserves prompt + min(max_tokens, decode_reserve_tokens): every admitted
    # request holds its whole lump, so the bound is 0 preemptions whenever max_tokens <=
    # decode_reserve_tokens. FCFS reserves only the prompt and thrashes.
    preemptions, recomputed = burst("lumpy")
    assert (preemptions, recomputed) == (0, 0)
    preemptions, recomputed = burst("fcfs")
    assert preemptions > 0 and recomputed > 0


def lumps_and_text(scheduler, texts: dict[str, int]) -> dict[str, int]:
    """Three cold one-tile image requests of 24 tokens (6 blocks of 4 each, no decode
    reserve), then text requests of the given lengths; returns the limits."""
    limits = {}
    for rid in ("l1", "l2", "l3"):
        scheduler.add(make_request(rid, 24, images=[(2, 8, 1)]), 26)
        limits[rid] = 26
    for rid, n in texts.items():
        scheduler.add(make_request(rid, n), n + 2)
        limits[rid] = n + 2
    return limits


def test_lumps_leave_the_headroom_free_for_quick_requests():
    """20 blocks, headroom 5. t (2 blocks, quick) goes first; l1 and l2 leave 12 then 6
    free, above the 3 of the headroom t does not already use; l3 would leave 0 and
    waits. Without the headroom all four start. (Lumps yielding t's first step is off
    here: it is tested below.)"""
    options = {"admission": "lumpy", "decode_reserve_tokens": 0, "lump_yields_to_quick": False}
    scheduler = make_scheduler(num_blocks=20, lump_headroom=0.25, **options)
    lumps_and_text(scheduler, {"t": 8})
    plan = scheduler.schedule()
    assert [item.request_id for item in plan.scheduled] == ["t", "l1", "l2"]
    assert [s.request_id for s in scheduler.waiting] == ["l3"]
    unbounded = make_scheduler(num_blocks=20, lump_headroom=0.0, **options)
    lumps_and_text(unbounded, {"t": 8})
    assert [item.request_id for item in unbounded.schedule().scheduled] == [
        "t", "l1", "l2", "l3",
    ]  # fmt: skip


def test_quick_requests_pass_an_aged_lump_only_inside_the_headroom():
    """Everyone is aged at once (max_wait_steps 0), so the order is arrival: l1, l2 start
    (8 blocks left), l3 needs 6 and leaving the 5-block headroom it cannot: it blocks.
    t1 (2 blocks) passes inside the headroom; t2 (4 more: 6 > 5) does not, though the
    pool has room for it, so l3's wait is not stretched by quick arrivals. (Without the
    yield, tested below: with it, t1's step would hold l1 and l2 back one step.)"""
    scheduler = make_scheduler(
        num_blocks=20, admission="lumpy", decode_reserve_tokens=0, lump_headroom=0.25,
        max_wait_steps=0, lump_yields_to_quick=False,
    )  # fmt: skip
    lumps_and_text(scheduler, {"t1": 8, "t2": 16})
    plan = scheduler.schedule()
    assert [item.request_id for item in plan.scheduled] == ["l1", "l2", "t1"]
    assert [s.request_id for s in scheduler.waiting] == ["l3", "t2"]


def test_lump_prefill_is_capped_per_step_and_quick_prefill_is_not():
    scheduler = make_scheduler(
        num_blocks=64, admission="lumpy", lump_prefill_tokens_per_step=8,
        max_num_batched_tokens=64, lump_yields_to_quick=False,
    )  # fmt: skip
    scheduler.add(make_request("lump", 30, images=[(2, 8, 1)]), 32)
    scheduler.add(make_request("text", 20), 30)  # decodes while the lump prefills
    limits = {"lump": 32, "text": 30}
    steps = []
    while scheduler.has_unfinished():
        plan = run_step(scheduler, limits)
        steps.append({item.request_id: item.num_new_tokens for item in plan.scheduled})
    assert steps[0] == {"text": 20, "lump": 8}
    assert [step["lump"] for step in steps[:4]] == [8, 8, 8, 6]  # then it decodes
    assert all(step.get("lump", 1) == 1 for step in steps[4:])


def test_with_no_quick_request_lumps_take_the_whole_budget_until_one_arrives():
    scheduler = make_scheduler(
        num_blocks=64, admission="lumpy", lump_prefill_tokens_per_step=8,
        max_num_batched_tokens=24, lump_yields_to_quick=False,
    )  # fmt: skip
    scheduler.add(make_request("a", 40, images=[(2, 8, 1)]), 42)
    scheduler.add(make_request("b", 40, images=[(2, 8, 1)]), 42)
    limits = {"a": 42, "b": 42}
    first = run_step(scheduler, limits)
    assert {i.request_id: i.num_new_tokens for i in first.scheduled} == {"a": 24}
    # A text request ready to start brings the cap back for the lumps in its step.
    scheduler.add(make_request("t", 4), 6)
    limits["t"] = 6
    second = run_step(scheduler, limits)
    assert {i.request_id: i.num_new_tokens for i in second.scheduled} == {"a": 8, "t": 4}


def lump_with_texts(text_at: set[int], **options) -> list[dict[str, tuple[int, int]]]:
    """A 30-token request with a 1-tile image at positions 10-17 (cap 8 prefill tokens a
    step) and 6-token text requests added before the steps in `text_at`; per step,
    request id -> (tokens, tiles encoded)."""
    scheduler = make_scheduler(
        num_blocks=64, admission="lumpy", lump_prefill_tokens_per_step=8, **options
    )
    scheduler.add(make_request("lump", 30, images=[(10, 8, 1)]), 32)
    limits, steps = {"lump": 32}, []
    for step in range(40):
        if step in text_at:
            scheduler.add(make_request(f"t{step}", 6), 8)
            limits[f"t{step}"] = 8
        plan = scheduler.schedule()
        tiles = {
            item.request_id: tiles_encoded(scheduler, StepPlan([item])) for item in plan.scheduled
        }
        steps.append({item.request_id: (item.num_new_tokens, tiles[item.request_id])
                      for item in plan.scheduled})  # fmt: skip
        scheduler.update(plan, [[7] if item.sample else [] for item in plan.scheduled])
        for item in plan.scheduled:
            seq = scheduler.seqs[item.request_id]
            if seq.num_tokens >= limits[seq.request_id]:
                scheduler.finish(seq)
        scheduler.block_manager.check_integrity()
        if not scheduler.has_unfinished():
            break
    return steps


def test_a_step_with_a_quick_first_token_leaves_the_lumps_out():
    """Text requests arrive before steps 0, 1 and 3. Step 0 starts t0 and the lump waits;
    step 1 starts t1 but may not hold the lump back again: the lump runs its chunk (8
    tokens, up to its image); step 2 runs the lump's image chunk with its tower tile; step
    3 starts t3 and the lump sits out again. Off, every step carries the lump."""
    steps = lump_with_texts({0, 1, 3})
    assert steps[0] == {"t0": (6, 0)}
    assert steps[1] == {"t0": (1, 0), "lump": (8, 0), "t1": (6, 0)}
    assert steps[2]["lump"] == (8, 1)
    assert "lump" not in steps[3] and steps[3]["t3"] == (6, 0)
    assert steps[4]["lump"] == (8, 0)
    off = lump_with_texts({0, 1, 3}, lump_yields_to_quick=False)
    assert [step["lump"] for step in off[:4]] == [(8, 0), (8, 1), (8, 0), (6, 0)]
    assert off[0]["t0"] == (6, 0) and off[3]["t3"] == (6, 0)


def test_lumps_yield_at_most_every_other_step_to_an_endless_stream():
    """A text request before every step: the lump still prefills (30 tokens, 8 a step)
    in every other step, so its first token comes by step 7 instead of step 3."""
    steps = lump_with_texts(set(range(40)))
    prefill = [i for i, step in enumerate(steps) if step.get("lump", (1, 0))[0] > 1]
    assert prefill == [1, 3, 5, 7]
    assert all(f"t{i}" in steps[i] for i in range(12))  # every text starts on arrival


def test_an_aged_lump_yields_only_to_a_quick_request_inside_the_headroom():
    """With max_wait_steps=0 everyone is aged: the lump (8 blocks) goes first. t0 (2
    blocks) may pass it inside the 19-block headroom, so its step holds the lump back,
    which starts the next step. With no headroom t0 may not pass: nothing yields and both
    start at once, the lump first."""
    steps = lump_with_texts({0}, max_wait_steps=0)
    assert steps[0] == {"t0": (6, 0)}
    assert steps[1] == {"t0": (1, 0), "lump": (8, 0)}
    steps = lump_with_texts({0}, max_wait_steps=0, lump_headroom=0.0)
    assert list(steps[0].items()) == [("lump", (8, 0)), ("t0", (6, 0))]

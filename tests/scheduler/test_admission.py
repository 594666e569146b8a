"""Admission policies: reservation, order, overtaking, victims, and the arrival check."""

from __future__ import annotations

import math
import random

import pytest
from sched_testing import make_request, make_scheduler, run_step

from scheduler.admission import (
    Candidate,
    FcfsAdmission,
    LumpyAdmission,
    head_reservation,
    reserved_tokens,
)
from scheduler.config import CacheConfig, SchedulerConfig, SloConfig
from scheduler.planner import Scheduler


def test_reservation_is_prompt_plus_capped_growth_within_the_pool():
    assert reserved_tokens(100, 100, 1100, 256, 10_000) == 356  # growth capped at 256
    assert reserved_tokens(100, 100, 120, 256, 10_000) == 120  # max_tokens is smaller
    assert reserved_tokens(100, 100, None, 256, 300) == 300  # never over the pool
    assert reserved_tokens(400, 100, 1100, 256, 10_000) == 400  # already past it


def test_lumpy_order_puts_aged_then_quick_first_and_only_aged_block_others():
    seqs = [make_request(f"r{i}", 4) for i in range(4)]
    cold, quick, aged, cold2 = (
        Candidate(seqs[0], quick=False, aged=False),
        Candidate(seqs[1], quick=True, aged=False),
        Candidate(seqs[2], quick=False, aged=True),
        Candidate(seqs[3], quick=False, aged=False),
    )
    policy = LumpyAdmission(num_blocks=100, block_size=4, watermark=0.01, decode_reserve_tokens=8)
    assert policy.order([cold, quick, aged, cold2]) == [aged, quick, cold, cold2]
    assert policy.may_overtake(cold) and not policy.may_overtake(aged)
    fcfs = FcfsAdmission(num_blocks=100, watermark=0.01)
    assert fcfs.order([cold, quick, aged]) == [cold, quick, aged]
    assert not fcfs.may_overtake(cold)


def test_never_fits_is_refused_at_arrival_naming_both_numbers():
    scheduler = make_scheduler(num_blocks=10, block_size=4)
    assert scheduler.check_fits(20, 20) is None
    message = scheduler.check_fits(30, 20)
    assert "13 KV blocks" in message and "30 prompt + 20 output" in message
    assert "holds 10" in message
    big_pool = make_scheduler(num_blocks=200, block_size=4)  # watermark: 2 blocks
    message = big_pool.check_fits(795, 1)
    assert "199 KV blocks at once (795 tokens)" in message and "198 can be reserved" in message
    chunkless = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16)
    assert "over max_num_batched_tokens=16" in chunkless.check_fits(17, 1)


def test_preempted_request_waits_for_its_lump_plus_the_watermark():
    """Hysteresis: a and b (12-token prompts, 26 tokens at most) share 8 blocks of 4. At
    16 tokens each holds 4 and a needs a fifth: b (equal cost, newer) is preempted. It
    needs 5 blocks back; while a grows from 5 to 7 blocks, 3 then 1 are free, so b does
    not come back (no thrash) until a has finished."""
    scheduler = make_scheduler(num_blocks=8, admission="lumpy", decode_reserve_tokens=0)
    a, b = make_request("a", 12), make_request("b", 12)
    limits = {"a": 26, "b": 26}
    scheduler.add(a, 26)
    scheduler.add(b, 26)
    run_step(scheduler, limits)  # both prefilled: 3 + 3 blocks
    preempted_at = None
    for step in range(40):
        plan = run_step(scheduler, limits)
        if plan.preempted and preempted_at is None:
            preempted_at = step
            assert plan.preempted == ("b",)
        if preempted_at is not None and a.status != "finished":
            assert b.status == "waiting", "re-admitted before the pool had its lump free"
        if not scheduler.has_unfinished():
            break
    assert preempted_at is not None and scheduler.num_preemptions == 1
    assert b.status == "finished" and len(b.token_ids) == 26


def test_lump_headroom_is_kept_for_quick_requests_and_shared_by_them():
    # 100 blocks, no watermark, headroom 20 blocks.
    policy = LumpyAdmission(
        num_blocks=100, block_size=4, watermark=0.0, decode_reserve_tokens=0, headroom=0.2
    )
    seqs = [make_request(f"r{i}", 4) for i in range(3)]
    lump, quick = Candidate(seqs[0], False, False), Candidate(seqs[1], True, False)
    aged_lump = Candidate(seqs[2], False, True)
    assert policy.can_admit(lump, 60, 80, quick_blocks=0)  # 20 left: the headroom
    assert not policy.can_admit(lump, 61, 80, quick_blocks=0)
    assert policy.can_admit(lump, 65, 80, quick_blocks=5)  # quick ones already use 5
    assert policy.can_admit(quick, 80, 80, quick_blocks=0)  # quick ones may take it all
    assert policy.lump_headroom(60) == 20 and policy.lump_headroom(90) == 10
    assert policy.lump_headroom(100) == 0  # a lump of the whole pool can still start
    # Behind a blocked aged lump, quick requests pass only inside the headroom.
    assert policy.may_pass(aged_lump, 60, quick, 15, quick_blocks=5)
    assert not policy.may_pass(aged_lump, 60, quick, 16, quick_blocks=5)
    assert not policy.may_pass(aged_lump, 90, quick, 6, quick_blocks=5)  # shrunk to 10
    assert not policy.may_pass(aged_lump, 60, lump, 1, quick_blocks=0)
    assert not policy.may_pass(Candidate(seqs[1], True, True), 1, quick, 1, quick_blocks=0)
    fcfs = FcfsAdmission(num_blocks=100, watermark=0.0)
    assert not fcfs.may_pass(aged_lump, 60, quick, 1, quick_blocks=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("admission", "lifo"), ("max_wait_steps", -1), ("encoder_tiles_per_step", 0),
     ("decode_reserve_tokens", -1), ("lump_headroom", 1.0),
     ("lump_prefill_tokens_per_step", 0)],
)  # fmt: skip
def test_config_names_the_bad_value(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_head_reservation_finds_the_shadow_step_and_the_extra():
    head = Candidate(make_request("img", 4), quick=False, aged=False, slack_s=1.0)
    # Needs 30 available, 10 now; ends: in 5 steps 8 blocks, in 9 steps 15, in 20 steps 6.
    releases = [(9.0, 15, 0), (5.0, 8, 0), (20.0, 6, 0)]
    r = head_reservation(head, 25, 30, 10, releases)
    assert (r.shadow_steps, r.extra_blocks) == (9.0, 3)  # 10 + 8 + 15 = 33 at step 9
    assert r.admits(final_blocks=3, lifetime_steps=100)  # inside the extra: uses it up
    assert r.extra_blocks == 0 and not r.admits(1, 10) and r.admits(50, 9)  # or done by 9
    # Growth past reservations still to come shrinks the extra, not the shadow.
    r = head_reservation(head, 25, 30, 10, [(5.0, 8, 0), (9.0, 15, 2)])
    assert (r.shadow_steps, r.extra_blocks) == (9.0, 1)
    # Fits now (waits for tower or token room): no shadow, the rest is the extra.
    r = head_reservation(head, 25, 30, 34, releases)
    assert (r.shadow_steps, r.extra_blocks) == (0.0, 4)
    # A later request that can still make its target and does not start comes first.
    r = head_reservation(head, 25, 30, 10, releases)
    r.queue_behind(2)
    assert r.extra_blocks == 1 and not r.admits(2, 100) and r.admits(1, 100)
    # An unknown length before the shadow, or a pool that never frees enough: no backfill.
    for releases in ([(5.0, 8, 0), (math.inf, 30, 0)], [(5.0, 8, 0)]):
        r = head_reservation(head, 25, 30, 10, releases)
        assert (r.shadow_steps, r.extra_blocks) == (0.0, 0) and not r.admits(1, 1)


def _head_start(slo: SloConfig, text_every: int | None, seed: int = 0) -> tuple[int, int]:
    """(the step a waiting image lump starts, text requests started before it). Three
    running requests of known lengths reserve 41 of 48 blocks; the lump (26 blocks)
    arrives next and needs two of them to finish; text requests with random output
    lengths arrive every `text_every` steps."""
    config = SchedulerConfig(max_num_batched_tokens=128, admission="lumpy", slo=slo)
    now = [0.0]
    scheduler = Scheduler(config, CacheConfig(block_size=4), 48, clock=lambda: now[0])
    rng = random.Random(seed)
    limits = {}
    for name, output in (("r1", 12), ("r2", 25), ("r3", 40)):
        limits[name] = 28 + output
        scheduler.add(make_request(name, 28), limits[name])
    run_step(scheduler, limits)
    limits["img"] = 104
    scheduler.add(make_request("img", 100, images=[(2, 80, 1)]), 104)
    num_text = 0
    for step in range(200):
        if text_every and step % text_every == 0:
            text = make_request(f"t{step}", 6)
            limits[text.request_id] = 6 + rng.randint(1, 40)
            scheduler.add(text, limits[text.request_id])
        plan = run_step(scheduler, limits)
        now[0] += 0.01
        started = {item.request_id for item in plan.scheduled if item.num_computed_tokens == 0}
        if "img" in started:
            return step, num_text
        num_text += sum(1 for rid in started if rid.startswith("t"))
    raise AssertionError("the image never started")


@pytest.mark.parametrize("seed", range(6))
def test_backfilled_text_never_delays_the_head_image(seed):
    slo = SloConfig(ttft_s=100.0)  # every request can make it: the image is the head
    alone, _ = _head_start(slo, text_every=None)
    for every in (1, 2, 3):
        start, num_text = _head_start(slo, every, seed)
        assert start <= alone, (every, start, alone)
        assert num_text > 0  # text did pass it, where it could not use the room anyway
    # Without targets there is no head: the text stream takes the freed blocks first.
    delayed, _ = _head_start(SloConfig(), text_every=1, seed=seed)
    assert delayed > alone


def test_headroom_follows_the_quick_requests_high_water_mark_up_to_the_cap():
    policy = LumpyAdmission(
        num_blocks=100, block_size=4, watermark=0.0, decode_reserve_tokens=0, headroom=0.3
    )
    assert policy.lump_headroom(10) == 30  # nothing seen yet: the whole configured share
    for _ in range(3000):  # quick requests hold 5 blocks for a long while
        policy.observe_quick_demand(5)
    assert policy.lump_headroom(10) == 5  # decayed to what they hold
    policy.observe_quick_demand(12)  # a rise counts at once
    assert policy.lump_headroom(10) == 12
    policy.observe_quick_demand(5)
    assert policy.lump_headroom(10) == 12  # and is kept for a while
    policy.observe_quick_demand(80)
    assert policy.lump_headroom(10) == 30 and policy.lump_headroom(90) == 10  # capped
    lump = Candidate(make_request("lump", 4), quick=False, aged=False)
    for _ in range(3000):
        policy.observe_quick_demand(5)
    # A lump must now leave only the 5 blocks quick requests lately held (not 30).
    assert policy.can_admit(lump, 90, 95, quick_blocks=0)
    assert not policy.can_admit(lump, 90, 94, quick_blocks=0)


def test_nobody_passes_a_head_with_less_than_half_its_target_left():
    """A 1 s TTFT target and 10 ms steps. One running request holds 48 of 64 blocks for
    150 steps, past the waiting image's deadline; a 2-step text request arrives every
    step, which the extra (and the shadow) would admit. Until the image has used half its
    target they pass it; from then on (step 50) none does: strict order behind it."""
    config = SchedulerConfig(max_num_batched_tokens=128, admission="lumpy",
                             slo=SloConfig(ttft_s=1.0))  # fmt: skip
    now = [0.0]
    scheduler = Scheduler(config, CacheConfig(block_size=4), 64, clock=lambda: now[0])
    limits = {"r1": 190}
    scheduler.add(make_request("r1", 40), 190)
    run_step(scheduler, limits)
    scheduler.add(make_request("img", 100, images=[(2, 80, 1)]), 104)
    limits["img"] = 104
    text_started = []
    for step in range(90):
        text = make_request(f"t{step}", 6)
        limits[text.request_id] = 8
        scheduler.add(text, 8)
        plan = run_step(scheduler, limits)
        now[0] += 0.01
        if any(i.request_id == text.request_id for i in plan.scheduled):
            text_started.append(step)
    assert text_started[0] == 0 and 45 <= max(text_started) < 50, text_started


@pytest.mark.parametrize("admission", ["fcfs", "lumpy"])
@pytest.mark.parametrize("kv_windows", [(None,), (None, 24, 24, 24)], ids=["one-group", "hybrid"])
def test_whatever_check_fits_accepts_starts_on_an_empty_pool(admission, kv_windows):
    """The arrival check and admission agree: a request `check_fits` lets in starts at the
    first step of an empty engine, at every size up to the pool's, lumps (prompts over the
    step budget) included (a hybrid pool's null block is never free: counted as usable, a
    lump filling the pool waited for ever)."""
    started = 0
    for num_tokens in range(4, 480, 3):
        scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=32, admission=admission),
            CacheConfig(block_size=4), num_blocks=120, kv_windows=kv_windows,
        )  # fmt: skip
        if scheduler.check_fits(num_tokens, 4) is not None:
            continue
        seq = make_request("r", num_tokens)
        scheduler.add(seq, num_tokens + 4)
        plan = scheduler.schedule()
        assert [item.request_id for item in plan.scheduled] == ["r"], num_tokens
        started += 1
    assert started >= 8  # sizes on both sides of the headroom were tried


def urgent_start_step(admission: str) -> int:
    """Held-out trace img30-lognormal-bursts/seed606's lost image request, in small: a 40
    block pool, two running decodes, a short one (10 blocks, 4 tokens left) and a long one
    (2 blocks now, 12 at its end in 40 steps: 10 blocks of growth reserved). A request
    whose SLO is at stake (0.4 s of its 1 s target left) needs 24 blocks: 28 are free
    but only 17 are not reserved. The step (from 0) it starts in."""
    config = SchedulerConfig(max_num_batched_tokens=128, admission=admission,
                             lump_headroom=0.0, slo=SloConfig(ttft_s=1.0))  # fmt: skip
    now = [0.0]
    scheduler = Scheduler(config, CacheConfig(block_size=4, watermark=0.0), 40,
                          clock=lambda: now[0])  # fmt: skip
    limits = {"short": 40, "long": 48}
    scheduler.add(make_request("short", 36), 40)
    scheduler.add(make_request("long", 7), 48)
    run_step(scheduler, limits)  # both prefill and sample their first token
    urgent = make_request("urgent", 92)
    urgent.arrival_time = now[0] - 0.6
    scheduler.add(urgent, 93)
    limits["urgent"] = 93
    for step in range(10):
        plan = run_step(scheduler, limits)
        now[0] += 0.01
        if any(i.request_id == "urgent" for i in plan.scheduled):
            return step
    raise AssertionError("the urgent request never started")


def test_an_urgent_request_starts_when_the_time_line_shows_no_collision():
    """The reservations summed at once say no; the time line says yes: the short decode
    ends and frees 10 blocks long before the long one has grown into its reservation, so
    the urgent request starts now, as FCFS starts it (without the time line it waited
    until the short one ended, step 3)."""
    assert urgent_start_step("lumpy") == urgent_start_step("fcfs") == 0

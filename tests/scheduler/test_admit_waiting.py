"""`WaitingAdmission.never_starts`: the engine's guard against spinning on a request the
scheduler cannot start on an idle engine (the policy and `check_fits` disagreeing)."""

from __future__ import annotations

from scheduler.step_plan import StepPlan
from tests.scheduler.sched_testing import RefusesOne, make_request, make_scheduler, run_step


def idle_plans_until_named(scheduler, limit: int = 200) -> int | None:
    """Empty plans `never_starts` sees before it names a request (None: never)."""
    for n in range(limit):
        plan = scheduler.schedule()
        assert plan.is_empty
        if scheduler.never_starts(plan) is not None:
            return n
    return None


def test_a_request_no_idle_step_starts_is_named_after_the_aging_bound():
    scheduler = make_scheduler(max_wait_steps=5)
    scheduler.admission = RefusesOne(scheduler.admission)
    scheduler.add(make_request("bad", 8), 12)
    assert idle_plans_until_named(scheduler) == 6  # the aging bound + 1 plans leave it be
    # Not while its images decode: readiness can still change.
    scheduler = make_scheduler(max_wait_steps=5)
    scheduler.add(make_request("img", 8, ready=False), 12)
    assert idle_plans_until_named(scheduler, 50) is None


def test_a_step_with_work_resets_the_count_and_ordinary_traffic_is_never_named():
    scheduler = make_scheduler(num_blocks=16, max_wait_steps=3)
    limits = {}
    for i in range(12):  # more than the pool holds at once: requests wait for KV
        scheduler.add(make_request(f"r{i}", 20), 28)
        limits[f"r{i}"] = 28
    while scheduler.has_unfinished():
        plan = run_step(scheduler, limits)
        assert scheduler.never_starts(plan) is None
    scheduler._num_idle_plans = 3  # as after idle plans: a plan with work clears it
    scheduler.add(make_request("next", 4), 6)
    plan = scheduler.schedule()
    assert scheduler.never_starts(plan) is None and scheduler._num_idle_plans == 0
    assert scheduler.never_starts(StepPlan([])) is None  # running now: not idle


def test_fcfs_a_stuck_head_holds_the_queue_until_it_is_named():
    """FCFS: nobody passes the head, so a head that never starts keeps the request behind
    it waiting too: plans stay empty, the head (not the one behind it) is named after the
    aging bound, and once it is gone the next one starts. (Lumpy lets it pass at once.)"""
    for admission, passes in (("fcfs", False), ("lumpy", True)):
        scheduler = make_scheduler(max_wait_steps=5, admission=admission)
        scheduler.admission = RefusesOne(scheduler.admission)
        scheduler.add(make_request("bad", 8), 12)
        scheduler.add(make_request("next", 8), 12)
        plan = scheduler.schedule()
        assert [item.request_id for item in plan.scheduled] == (["next"] if passes else [])
        if passes:
            continue
        assert scheduler.never_starts(plan) is None
        for _ in range(5):  # the aging bound: the queue stays held, nobody named yet
            plan = scheduler.schedule()
            assert plan.is_empty and scheduler.never_starts(plan) is None
        plan = scheduler.schedule()
        stuck = scheduler.never_starts(plan)
        assert plan.is_empty and stuck is not None and stuck.request_id == "bad"
        scheduler.finish(stuck)  # as the engine fails it
        assert [item.request_id for item in scheduler.schedule().scheduled] == ["next"]

"""The adaptive γ policy, and how the planner schedules and rolls back drafts."""

import pytest

from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from scheduler.planner import Scheduler
from scheduler.sequence import Sequence
from scheduler.spec_policy import SpecPolicy
from search.costmodel.cost_model import spec_speedup


def test_step_gamma_keeps_rows_under_the_ridge():
    config = SpeculativeConfig(num_speculative_tokens=4)
    policy = SpecPolicy(config, ridge_batch=40, speedup=spec_speedup)
    assert policy.step_gamma(1) == 4  # capped by γ_max
    assert policy.step_gamma(8) == 4  # 8·5 = 40 ≤ B*
    assert policy.step_gamma(10) == 3
    assert policy.step_gamma(20) == 1
    assert policy.step_gamma(21) == 0  # 21·2 = 42 > B*: off
    assert policy.step_gamma(8, num_other_rows=16) == 2  # prefill rows use the room too
    fixed = SpecPolicy(SpeculativeConfig(num_speculative_tokens=4, adaptive=False), 40)
    assert fixed.step_gamma(100) == 4


def test_seq_gamma_follows_the_acceptance_rate_and_probes_again():
    config = SpeculativeConfig(num_speculative_tokens=6, probe_interval=4)
    policy = SpecPolicy(config, ridge_batch=1e9, speedup=spec_speedup)
    # Prior α = 0.5, c = 0.1: E[tokens]/(1 + γc) peaks at γ = 2 (1.46 vs 1.36 and 1.44).
    assert policy.seq_gamma("a", 6) == 2
    num_rejected = 0
    while (gamma := policy.seq_gamma("a", 6)) > 0:
        policy.record("a", gamma, 0)
        num_rejected += 1
    assert num_rejected == 5 and policy.acceptance_rate("a") < config.row_cost
    # Switched off: one draft every probe_interval decode steps.
    assert [policy.seq_gamma("a", 6) for _ in range(8)] == [0, 0, 1, 0, 0, 0, 1, 0]
    policy.record("a", 1, 1)  # the probe hit: back on
    assert policy.seq_gamma("a", 6) == 1
    for _ in range(10):
        policy.record("b", 6, 6)
    assert policy.seq_gamma("b", 6) == 6
    assert policy.seq_gamma("b", 0) == 0  # the step gate wins


def test_metrics_count_proposed_and_accepted():
    policy = SpecPolicy(
        SpeculativeConfig(num_speculative_tokens=4), ridge_batch=1e9, speedup=spec_speedup
    )
    policy.record("a", 4, 4)
    policy.record("a", 3, 1)
    policy.record("b", 0, 0)  # nothing proposed: not a verification
    m = policy.metrics
    assert (m.num_proposed_tokens, m.num_accepted_tokens, m.num_verifications) == (7, 5, 2)
    assert m.mean_accepted_length == 2.5 and m.acceptance_rate == 5 / 7


def make_scheduler(num_blocks=16, budget=64, **spec) -> Scheduler:
    spec = SpeculativeConfig(**{"num_speculative_tokens": 3, "adaptive": False, **spec})
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget),
        CacheConfig(block_size=4),
        num_blocks,
        speculative=spec,
        spec_speedup=spec_speedup,
    )


def start_decoding(scheduler: Scheduler, max_num_tokens: int | None = None) -> Sequence:
    """A sequence [1 2 3 4 1 2 3] prefilled, its first output 4: the suffix [1 2 3 4]
    was followed by [1 2 3], so those are the drafts."""
    seq = Sequence("a", [1, 2, 3, 4, 1, 2, 3])
    scheduler.add(seq, max_num_tokens)
    while seq.num_computed_tokens < 7:  # (prefill chunks under a small budget)
        plan = scheduler.schedule()
        scheduler.update(plan, [[4] if item.sample else [] for item in plan.scheduled])
    return seq


def test_decode_gets_draft_rows_and_rejected_blocks_roll_back():
    scheduler = make_scheduler()
    bm = scheduler.block_manager
    seq = start_decoding(scheduler)
    plan = scheduler.schedule()
    [item] = plan.scheduled
    assert item.draft_token_ids == (1, 2, 3) and item.num_new_tokens == 4 and item.sample
    assert plan.num_batched_tokens == 4
    assert len(seq.block_table) == 3  # room for positions 7..10
    # Draft 1 accepted, draft 2 rejected (the target said 5): 2 tokens, KV of 7 and 8 kept.
    scheduler.update(plan, [[1, 5]])
    assert seq.token_ids == [1, 2, 3, 4, 1, 2, 3, 4, 1, 5]
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3
    assert scheduler.spec_policy.metrics.num_accepted_tokens == 1
    plan = scheduler.schedule()
    [item] = plan.scheduled
    assert item.draft_token_ids == ()  # [1 5] and [5] never seen before: no drafts
    assert item.num_new_tokens == 1
    scheduler.update(plan, [[7]])
    bm.check_integrity()
    scheduler.finish(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_full_rejection_shrinks_the_block_table():
    scheduler = make_scheduler()
    seq = start_decoding(scheduler)
    plan = scheduler.schedule()
    assert len(seq.block_table) == 3
    scheduler.update(plan, [[6]])  # first draft rejected: only the last real token's KV
    assert seq.num_computed_tokens == 8 and len(seq.block_table) == 2
    scheduler.block_manager.check_integrity()
    # Only accepted tokens are registered in the prefix cache: the 2 full blocks.
    assert len(scheduler.block_manager._cached) == 2


def test_drafts_never_overshoot_max_tokens_or_the_budget():
    scheduler = make_scheduler()
    start_decoding(scheduler, max_num_tokens=10)  # 8 tokens now: 2 more at most
    [item] = scheduler.schedule().scheduled
    assert item.draft_token_ids == (1,)
    scheduler = make_scheduler(budget=3)
    start_decoding(scheduler)
    [item] = scheduler.schedule().scheduled
    assert item.draft_token_ids == (1, 2)


def test_no_drafts_past_the_ridge_or_without_free_blocks():
    scheduler = make_scheduler(adaptive=True, ridge_batch=1.5)
    start_decoding(scheduler)
    [item] = scheduler.schedule().scheduled
    assert item.draft_token_ids == () and item.num_new_tokens == 1
    # 2 blocks hold the 8 tokens; drafts would need a third that does not exist.
    scheduler = make_scheduler(num_blocks=2)
    seq = start_decoding(scheduler)
    plan = scheduler.schedule()
    assert plan.scheduled[0].draft_token_ids == () and not plan.preempted
    assert seq.status == "running"


def test_adaptive_speculation_needs_the_speedup_model():
    with pytest.raises(ValueError, match="speed-up model"):
        SpecPolicy(SpeculativeConfig(num_speculative_tokens=4), ridge_batch=40)
    SpecPolicy(SpeculativeConfig(num_speculative_tokens=4, adaptive=False), ridge_batch=40)

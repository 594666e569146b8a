"""Async scheduling on the scheduler side: planning step i+1 while step i is in flight."""

from __future__ import annotations

from sched_testing import make_request, make_scheduler

from scheduler.in_flight import advance, resolve
from scheduler.prefix_hash import extend_block_hashes


def test_a_decode_is_planned_on_the_token_still_in_flight_and_resolved_after():
    scheduler = make_scheduler(block_size=4)
    seq = make_request("a", 6)
    scheduler.add(seq, 6 + 3)
    first = advance(scheduler.schedule(), scheduler.seqs)  # the prefill, sampling token 6
    assert (seq.num_computed_tokens, seq.num_pending_tokens, seq.num_tokens) == (6, 1, 7)
    plan = scheduler.schedule()  # planned before token 6 is known
    [item] = plan.scheduled
    assert (item.num_new_tokens, item.sample) == (1, True)
    second = advance(plan, scheduler.seqs)
    assert (seq.num_computed_tokens, seq.num_pending_tokens) == (7, 2)
    resolve(first, [[41]], scheduler.seqs, scheduler.block_manager)
    assert seq.token_ids[-1] == 41 and seq.num_pending_tokens == 1
    # Only the blocks whose KV landed are findable: the prefill's one full block.
    assert len(scheduler.block_manager._cached) == 1
    resolve(second, [[42]], scheduler.seqs, scheduler.block_manager)
    assert seq.token_ids[-2:] == [41, 42] and seq.num_pending_tokens == 0
    assert len(scheduler.block_manager._cached) == 1  # 7 tokens: still one full block
    scheduler.block_manager.check_integrity()


def test_a_sequence_whose_last_token_is_in_flight_is_not_planned_again():
    scheduler = make_scheduler()
    seq = make_request("a", 5)
    scheduler.add(seq, 5 + 2)  # two output tokens
    first = advance(scheduler.schedule(), scheduler.seqs)
    second = advance(scheduler.schedule(), scheduler.seqs)  # the second and last token
    assert seq.num_tokens == 7
    plan = scheduler.schedule()
    assert plan.is_empty  # nothing to compute: no wasted row past max_tokens
    resolve(first, [[1]], scheduler.seqs, scheduler.block_manager)
    resolve(second, [[2]], scheduler.seqs, scheduler.block_manager)
    assert seq.token_ids[-2:] == [1, 2]


def test_a_finished_sequence_is_left_alone_and_a_preempted_one_keeps_its_token():
    scheduler = make_scheduler()
    done, preempted = make_request("done", 4), make_request("pre", 4)
    scheduler.add(done, 20)
    scheduler.add(preempted, 20)
    step = advance(scheduler.schedule(), scheduler.seqs)
    scheduler.finish(done)  # e.g. aborted while its step ran
    scheduler._preempt(preempted)
    assert preempted.num_pending_tokens == 1
    # Waiting with an unknown token: never admitted (or hashed) until it is back.
    assert scheduler.schedule().is_empty
    resolve(step, [[], [9]], scheduler.seqs, scheduler.block_manager)
    assert len(done.token_ids) == 4 and preempted.token_ids[-1] == 9
    assert preempted.num_pending_tokens == 0 and preempted.num_computed_tokens == 0
    [item] = scheduler.schedule().scheduled  # recomputed with its token
    assert item.request_id == "pre" and item.num_new_tokens == 5
    scheduler.block_manager.check_integrity()


def test_resolve_registers_the_blocks_of_the_resolved_step_only():
    scheduler = make_scheduler(block_size=4)
    seq = make_request("a", 8)
    scheduler.add(seq, 30)
    first = advance(scheduler.schedule(), scheduler.seqs)  # prefill: 8 tokens = 2 full blocks
    second = advance(scheduler.schedule(), scheduler.seqs)  # decode of position 8
    resolve(first, [[5]], scheduler.seqs, scheduler.block_manager)
    expected = extend_block_hashes(seq, 8, 4)
    assert set(scheduler.block_manager._cached) == set(expected)
    resolve(second, [[6]], scheduler.seqs, scheduler.block_manager)
    assert len(scheduler.block_manager._cached) == 2  # position 8 starts block 3

"""Async scheduling (NanoFlow §4.2.1): the scheduler's side of a step that is in flight.

The engine plans step i+1 while step i runs. To plan it, `advance` counts step i's rows as
computed and each of its samples as a pending token (`Sequence.num_pending_tokens`) as
soon as step i is launched: a decode of step i+1 then has the one uncomputed token it
needs, whose id the runner takes from step i's output when step i+1 runs. `resolve`
puts the real tokens in once step i's output is back.

What must stay true:
- a sequence has pending tokens only while the step that samples them is in flight, so
  the planner never hashes or admits a sequence with an unknown token (a sequence
  preempted meanwhile waits, not ready, until its token is back);
- a block is registered in the prefix cache only once the step that wrote its KV has
  come back (each item's `end`): a forward that fails never leaves its KV findable;
- a sequence that finished meanwhile (stop token, stop string, abort, failure) is left
  alone: its blocks are already free. Its extra token from a later in-flight step is
  computed for nothing and never emitted. Freeing blocks that an in-flight step still
  writes is safe because steps run in launch order: a later owner writes its own KV
  after that step, and reads only positions it wrote.
Speculating steps are never advanced: which KV they keep depends on the accepted drafts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduler.kv_blocks import BlockManager
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import Sequence
from scheduler.step_plan import StepPlan


@dataclass(frozen=True)
class LaunchedStep:
    """A plan whose step is in flight."""

    plan: StepPlan


def advance(plan: StepPlan, seqs: Mapping[str, Sequence]) -> LaunchedStep:
    """Count `plan`'s rows as computed and its samples as pending, before its step runs.
    `seqs`: the scheduler's sequences by request id."""
    for item in plan.scheduled:
        assert not item.draft_token_ids, "a speculating step is never advanced"
        seq = seqs[item.request_id]
        seq.num_computed_tokens += item.num_new_tokens
        seq.num_pending_tokens += int(item.sample)
    return LaunchedStep(plan)


def resolve(
    step: LaunchedStep,
    sampled: list[list[int]],
    seqs: Mapping[str, Sequence],
    block_manager: BlockManager,
) -> None:
    """`step` came back: `sampled[i]` is the token item i emitted ([] for a chunk that
    does not sample, and for a sequence that finished meanwhile)."""
    for item, tokens in zip(step.plan.scheduled, sampled, strict=True):
        seq = seqs.get(item.request_id)
        if seq is None:  # finished meanwhile
            continue
        if item.sample:
            assert len(tokens) == 1, f"{seq.request_id}: one token per sampled row, got {tokens}"
            assert seq.num_pending_tokens > 0, f"{seq.request_id}: no token was pending"
            seq.num_pending_tokens -= 1
            seq.token_ids.extend(tokens)
        if seq.status == "running":  # preempted meanwhile: its blocks went with it
            hashes = extend_block_hashes(seq, item.end, block_manager.block_size)
            block_manager.register_seq(hashes, seq)

"""Starting waiting sequences (the second half of a step's plan, after the running ones):
the ready candidates with their prefix-cache matches, the admission policy's order and
reservations (and, with TTFT targets, slack), each one's first chunk within the step's
token and tower room (`Scheduler._chunk`).

`WaitingAdmission` is a part of `scheduler.planner.Scheduler`, kept in its own module:
its methods read and change the scheduler state annotated below.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable

from scheduler.admission import AdmissionPolicy, Candidate
from scheduler.config import SchedulerConfig
from scheduler.encoder_budget import needs_tower
from scheduler.kv_blocks import BlockManager, PrefixHit
from scheduler.lump_budget import StepCost
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.spans import span_safe_prefix
from scheduler.step_plan import ScheduledSeq, schedule_item
from scheduler.step_room import Room, prefill_token_s, slack_s


class WaitingAdmission:
    """The Scheduler's admission of waiting sequences."""

    config: SchedulerConfig
    block_manager: BlockManager
    admission: AdmissionPolicy
    waiting: deque[Sequence]
    running: list[Sequence]
    block_size: int
    _max_num_tokens: dict[str, int]
    _admitted_at: dict[str, int]
    _quick_ids: set[str]
    max_drafts: int  # draft tokens a decode may carry (0: no speculation)
    _is_cached: Callable[[ImagePlaceholder], bool]
    _chunk: Callable[[Sequence, int, Room, bool], tuple[int, int] | None]
    step_cost: StepCost | None
    clock: Callable[[], float] | None

    def _candidates(self) -> list[tuple[Candidate, PrefixHit]]:
        """Ready waiting sequences, each with its prefix-cache match (blocks per group)."""
        out = []
        now = self.clock() if self.clock is not None else None
        token_s = prefill_token_s(self.step_cost, self.config.max_num_batched_tokens)
        for seq in self.waiting:
            # (Preempted while its last token is in flight: that token is unknown yet.)
            if not seq.ready or seq.num_pending_tokens:
                continue
            matched = self._match(seq)
            num_cached = matched.num_blocks * self.block_size
            tower = any(
                needs_tower(img, num_cached, seq.num_tokens, num_cached, self._is_cached(img))
                for img in seq.images
            )
            quick = not tower and seq.num_tokens - num_cached <= self.config.max_num_batched_tokens
            aged = seq.num_waiting_steps >= self.config.max_wait_steps
            prefill_s = (seq.num_tokens - num_cached) * token_s
            slack = slack_s(seq, self.config.slo, now, prefill_s)
            out.append((Candidate(seq, quick, aged, slack), matched))
        return out

    def _match(self, seq: Sequence) -> PrefixHit:
        """`seq`'s prefix-cache match now (blocks per group)."""
        hashes = extend_block_hashes(seq, seq.num_tokens, self.block_size)
        # Keep at least one token to compute: its logits give the next token. Prompt
        # logprobs: no match. A match may not end inside an image (scheduler/spans.py).
        max_blocks = (seq.num_tokens - 1) // self.block_size if seq.use_prefix_cache else 0
        safe = functools.partial(span_safe_prefix, seq.spans) if seq.spans else None
        return self.block_manager.find_prefix(hashes, max_blocks, safe)

    def _admit(self, room: Room, quick_only: bool = False) -> list[ScheduledSeq]:
        """Start waiting sequences in the policy's order while `room` and the pool allow;
        `quick_only`: quick ones alone; the others count as not fitting, so quick ones pass
        an aged lump only where the policy lets them pass one that does not fit."""
        bm, policy, scheduled = self.block_manager, self.admission, []
        found = self._candidates()
        if not found:  # nothing to admit: skip the reservations' sums over every runner
            return scheduled
        # Blocks that admitted sequences have yet to take are spoken for: the rest of
        # their prompt and (lumpy) their expected growth.
        # (A speculating sequence may hold more than its tokens need: that is not a credit.)
        # (A sliding group's blocks count at their peak: the window and its biggest step.)
        reserved = quick_blocks = 0
        hybrid = bm.null_block is not None
        for s in self.running:
            target = bm.footprint(self._reserve(s), self._step_tokens(s) if hybrid else None)
            held = bm.held_blocks(s)
            reserved += max(0, target - held)
            if s.request_id in self._quick_ids:
                quick_blocks += max(held, target)
        available = bm.num_free_blocks - reserved
        matches = {id(c.seq): m for c, m in found}
        blocked: tuple[Candidate, int] | None = None  # an aged candidate that did not fit
        for cand in policy.order([c for c, _ in found]):
            seq = cand.seq
            if room.tokens <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            # A start before it in this loop may have evicted a free block of its match.
            matched = self._match(seq) if scheduled else matches[id(seq)]
            num_cached = matched.num_blocks * self.block_size
            cost = bm.cost_of(matched, self._reserve(seq), self._step_tokens(seq, num_cached))
            if blocked is not None and not policy.may_pass(*blocked, cand, cost, quick_blocks):
                continue
            chunk = self._chunk(seq, num_cached, room, not cand.quick)
            fits = chunk is not None and policy.can_admit(cand, cost, available, quick_blocks)
            if not fits or (quick_only and not cand.quick):
                if policy.may_overtake(cand):
                    continue
                if blocked is not None:
                    break
                blocked = (cand, cost)  # later ones start only if the policy lets them pass
                continue
            num_new, tiles = chunk
            room.tiles_used += tiles
            self._start(seq, matched, num_cached, num_new, cand.quick)
            scheduled.append(schedule_item(seq, num_new, num_cached + num_new == seq.num_tokens))
            available -= cost
            if cand.quick:
                quick_blocks += cost
            room.spend(num_cached, num_new, tiles, not cand.quick, decode=False)
        return scheduled

    def _start(
        self, seq: Sequence, matched: PrefixHit, num_cached: int, num_new: int, quick: bool
    ) -> None:
        """Move `seq` from waiting to running with its prefix-cache blocks and its first
        chunk's blocks."""
        bm = self.block_manager
        bm.take(seq, matched)
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
        bm.grow(seq, num_cached + num_new)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = "running"
        seq.num_waiting_steps = 0
        self._admitted_at[seq.request_id] = num_cached
        if quick:
            self._quick_ids.add(seq.request_id)

    def _step_tokens(self, seq: Sequence, num_computed: int | None = None) -> int:
        """The most tokens one step computes for `seq` from `num_computed` on (default:
        its own): the rest of its prefill, at most the step budget, or a decode and its
        drafts. Hybrid KV: what a sliding group holds beyond its window."""
        done = seq.num_computed_tokens if num_computed is None else num_computed
        rest = min(seq.num_tokens - done, self.config.max_num_batched_tokens)
        return max(rest, 1 + self.max_drafts)

    def _reserve(self, seq: Sequence) -> int:
        return self.admission.reserve_tokens(seq, self._max_num_tokens.get(seq.request_id))

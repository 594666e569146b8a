"""Starting waiting sequences (the second half of a step's plan, after the running ones):
the ready candidates with their prefix-cache matches, the admission policy's order and
reservations (and, with TTFT targets, slack), each one's first chunk within the step's
token and tower room (`Scheduler._chunk`).

`WaitingAdmission` is a part of `scheduler.planner.Scheduler`, kept in its own module:
its methods read and change the scheduler state annotated below.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from scheduler.admission import AdmissionPolicy, Candidate, HeadReservation, head_reservation
from scheduler.config import SchedulerConfig
from scheduler.encoder_budget import needs_tower
from scheduler.kv_blocks import BlockManager
from scheduler.lump_budget import StepCost
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.spans import span_safe_prefix
from scheduler.step_plan import ScheduledSeq, schedule_item
from scheduler.step_room import Room, is_urgent, prefill_token_s, slack_s


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
    _kv_blocked: set[str]
    _is_cached: Callable[[ImagePlaceholder], bool]
    _chunk: Callable[[Sequence, int, Room, bool], tuple[int, int] | None]
    step_cost: StepCost | None
    clock: Callable[[], float] | None

    def _candidates(self) -> list[tuple[Candidate, list[int]]]:
        """Ready waiting sequences, each with its prefix-cache match (blocks)."""
        bm, out = self.block_manager, []
        now = self.clock() if self.clock is not None else None
        token_s = prefill_token_s(self.step_cost, self.config.max_num_batched_tokens)
        for seq in self.waiting:
            # (Preempted while its last token is in flight: that token is unknown yet.)
            if not seq.ready or seq.num_pending_tokens:
                continue
            hashes = extend_block_hashes(seq, seq.num_tokens, self.block_size)
            # Keep at least one token to compute: its logits give the next token.
            matched = bm.match_prefix(hashes)[: (seq.num_tokens - 1) // self.block_size]
            matched = matched if seq.use_prefix_cache else []  # prompt logprobs: none
            if seq.spans:  # a match may not end inside an image (scheduler/spans.py)
                reusable = span_safe_prefix(seq.spans, len(matched) * self.block_size)
                matched = matched[: reusable // self.block_size]
            num_cached = len(matched) * self.block_size
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
        reserved = sum(
            max(0, bm.blocks_for(self._reserve(s)) - len(s.block_table)) for s in self.running
        )
        available = bm.num_free_blocks - reserved
        quick_blocks = sum(
            max(len(s.block_table), bm.blocks_for(self._reserve(s)))
            for s in self.running
            if s.request_id in self._quick_ids
        )
        slo = self.config.slo
        if not quick_only and (slo.ttft_s is not None or slo.image_ttft_s is not None):
            # With targets the headroom follows what quick requests hold (once a step);
            # not what waits: text queued behind a burst of images it may not delay must
            # not widen its own lane (that would starve the images).
            policy.observe_quick_demand(quick_blocks)
        matches = {id(c.seq): m for c, m in found}
        blocked: tuple[Candidate, int] | None = None  # an aged candidate that did not fit
        head: HeadReservation | None = None  # the first that did not start, with slack
        self._kv_blocked = set()  # held back by the pool or the head, not by the step
        for cand in policy.order([c for c, _ in found]):
            seq = cand.seq
            if room.tokens <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            matched = matches[id(seq)]
            cost = bm.cost_of(matched, self._reserve(seq))
            if blocked is not None and not policy.may_pass(*blocked, cand, cost, quick_blocks):
                continue
            num_cached = len(matched) * self.block_size
            chunk = self._chunk(seq, num_cached, room, not cand.quick)
            fits = chunk is not None and policy.can_admit(cand, cost, available, quick_blocks)
            if fits and head is not None and not (quick_only and not cand.quick):
                if not self._backfills(head, cand, cost, num_cached, quick_blocks):
                    self._kv_blocked.add(seq.request_id)
                    fits = False
            elif chunk is not None and not fits:
                self._kv_blocked.add(seq.request_id)
            if not fits or (quick_only and not cand.quick):
                if policy.may_overtake(cand):
                    if head is not None and policy.reserves_for(cand):
                        head.queue_behind(cost)
                    elif head is None and blocked is None and policy.reserves_for(cand):
                        head = self._head(cand, cost, available, quick_blocks)
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

    def _backfills(
        self, head: HeadReservation, cand: Candidate, cost: int, num_cached: int,
        quick_blocks: int,
    ) -> bool:  # fmt: skip
        """Whether `cand` may start past `head` without delaying it: inside the headroom
        (the policy's rule), within the extra, or done before the shadow step."""
        now = self.clock() if self.clock is not None else None
        if is_urgent(head.cand.seq, self.config.slo, now):
            return False  # less than half its target left: strict order behind it
        if self.admission.may_pass(head.cand, head.blocks_needed, cand, cost, quick_blocks):
            return True
        seq, limit = cand.seq, self._max_num_tokens.get(cand.seq.request_id)
        final = max(cost, self.block_manager.blocks_for(limit) if limit else 0)
        # One step of margin: its first chunk may get less than a whole step's room.
        steps = self._steps_left(seq, seq.num_tokens - num_cached, capped=not cand.quick) + 1
        return head.admits(final, steps)

    def _head(
        self, cand: Candidate, cost: int, available: int, quick_blocks: int
    ) -> HeadReservation:
        """`cand`'s reservation against the running sequences' known ends."""
        bm, releases = self.block_manager, []
        for s in self.running:
            held = max(len(s.block_table), bm.blocks_for(self._reserve(s)))
            limit = self._max_num_tokens.get(s.request_id)
            final = max(held, bm.blocks_for(limit) if limit else 0)
            # Leading blocks another live sequence holds (a shared prefix) stay taken.
            shared = next(
                (i for i, b in enumerate(s.block_table) if bm.blocks[b].ref_count < 2),
                len(s.block_table),
            )
            # Its prefill at the whole step budget: the earliest it can end (a shadow too
            # late would let backfills delay the head).
            steps = self._steps_left(s, s.num_uncomputed_tokens, capped=False)
            releases.append((steps, final - shared, final - held))
        required = self.admission.required_blocks(cand, cost, quick_blocks)
        return head_reservation(cand, cost, required, available, releases)

    def _steps_left(self, seq: Sequence, num_uncomputed: int, capped: bool) -> float:
        """Steps (this one counted) until `seq` is done, given its tokens without KV: its
        prefill chunks (whole steps, or `capped` at the lumps' cap: the least they get),
        then a token a step up to its limit; inf without a limit. Planned this step or
        not, a running sequence's tokens are those before this step's."""
        limit = self._max_num_tokens.get(seq.request_id)
        if limit is None:
            return math.inf
        per_step = self.config.max_num_batched_tokens
        if capped and self.admission.lump_prefill_tokens:
            per_step = min(per_step, self.admission.lump_prefill_tokens)
        prefill_steps = -(-num_uncomputed // per_step)
        # The last prefill step samples the first of the tokens still to come.
        return max(0, prefill_steps - 1) + max(1, limit - seq.num_tokens)

    def _start(
        self, seq: Sequence, matched: list[int], num_cached: int, num_new: int, quick: bool
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

    def _reserve(self, seq: Sequence) -> int:
        return self.admission.reserve_tokens(seq, self._max_num_tokens.get(seq.request_id))

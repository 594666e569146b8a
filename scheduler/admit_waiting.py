"""Starting waiting sequences (the second half of a step's plan, after the running ones):
the ready candidates with their prefix-cache matches, the admission policy's order and
reservations (and, with TTFT targets, slack), each one's first chunk within the step's
token and tower room (`Scheduler._chunk`).

`WaitingAdmission` is a part of `scheduler.planner.Scheduler`, kept in its own module:
its methods read and change the scheduler state annotated below.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable

from scheduler.admission import AdmissionPolicy, Candidate, HeadReservation, head_reservation
from scheduler.config import SchedulerConfig
from scheduler.encoder_budget import needs_tower
from scheduler.kv_blocks import BlockManager, PrefixHit
from scheduler.lump_budget import StepCost, sliding_window
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.spans import span_safe_prefix
from scheduler.step_plan import ScheduledSeq, StepPlan, schedule_item
from scheduler.step_room import PrefillTime, Room, is_urgent, slack_s


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
    _kv_blocked: set[str]
    _is_cached: Callable[[ImagePlaceholder], bool]
    _chunk: Callable[[Sequence, int, Room, bool], tuple[int, int] | None]
    step_cost: StepCost | None
    clock: Callable[[], float] | None
    _num_idle_plans = 0  # consecutive plans `never_starts` found idle with work waiting

    def never_starts(self, plan: StepPlan) -> Sequence | None:
        """Called with each step's plan: the first waiting sequence once plans have been
        empty with nothing running or in flight and every waiting sequence ready, for
        more steps than aging takes (`max_wait_steps`). Then no step can free a block or
        change what admission sees but time (slack only orders) and new arrivals (which
        queue behind it): it never starts. Admission refuses at arrival what can never
        fit (`check_fits`), so this is a bug's symptom, and the engine fails that request
        instead of spinning on it forever."""
        idle = plan.is_empty and not self.running and bool(self.waiting)
        if not idle or any(not s.ready or s.num_pending_tokens for s in self.waiting):
            self._num_idle_plans = 0
            return None
        self._num_idle_plans += 1
        if self._num_idle_plans <= self.config.max_wait_steps + 1:
            return None
        self._num_idle_plans = 0
        return self.waiting[0]

    def _candidates(self) -> list[tuple[Candidate, PrefixHit]]:
        """Ready waiting sequences, each with its prefix-cache match (blocks per group)."""
        out = []
        now = self.clock() if self.clock is not None else None
        prefill_time = self._prefill_time()
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
            prefill_s = prefill_time(num_cached, seq.num_tokens - num_cached)
            slack = slack_s(seq, self.config.slo, now, prefill_s)
            out.append((Candidate(seq, quick, aged, slack), matched))
        return out

    def _prefill_time(self) -> PrefillTime:
        """Prefill seconds by the step-cost model, beside this step's running decodes."""
        decodes = [s for s in self.running if s.num_uncomputed_tokens <= 1]
        window = sliding_window(self.block_manager.windows)
        return PrefillTime(
            self.step_cost, self.config.max_num_batched_tokens, len(decodes),
            sum(s.num_tokens for s in decodes), window,
            sum(min(s.num_tokens, window) for s in decodes) if window else 0,
        )  # fmt: skip

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
            # A start before it in this loop may have evicted a free block of its match.
            matched = self._match(seq) if scheduled else matches[id(seq)]
            num_cached = matched.num_blocks * self.block_size
            cost = bm.cost_of(matched, self._reserve(seq), self._step_tokens(seq, num_cached))
            if blocked is not None and not policy.may_pass(*blocked, cand, cost, quick_blocks):
                continue
            chunk = self._chunk(seq, num_cached, room, not cand.quick)
            fits = chunk is not None and policy.can_admit(cand, cost, available, quick_blocks)
            if not fits and chunk is not None and head is None and blocked is None:
                fits = self._urgent(cand) and self._fits_time_line(cost)
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
        step = self._step_tokens(seq, num_cached)
        final = max(cost, self.block_manager.footprint(limit, step) if limit else 0)
        # One step of margin: its first chunk may get less than a whole step's room.
        steps = self._steps_left(seq, seq.num_tokens - num_cached, capped=not cand.quick) + 1
        return head.admits(final, steps)

    def _urgent(self, cand: Candidate) -> bool:
        """Whether `cand` can still make its TTFT target and has less than half of it left
        (`is_urgent`, the urgency at which nobody passes a head): its SLO is at stake."""
        now = self.clock() if self.clock is not None else None
        slack = cand.slack_s
        return slack is not None and slack >= 0 and is_urgent(cand.seq, self.config.slo, now)

    def _fits_time_line(self, num_blocks: int) -> bool:
        """Whether `num_blocks` more blocks, held from now on, keep the pool within its
        watermark at every step, given what the running sequences will hold and when they
        end: each grows by its decode (and drafts) a step up to its known length and frees
        its blocks after its last token; one still in prefill holds its whole prompt now
        and is never counted as ending. For the first request in the slack order when its
        SLO is at stake (`_urgent`) and the sum of every reservation at once says no: the
        reservations keep admitted requests from colliding, and so does this (with known
        lengths no one is preempted), but this one sees that sequences end and free their
        blocks before the others have grown into theirs. The quick requests' headroom is
        not kept either: it is for requests not here yet, which must not make one that is
        here miss its target. One KV group only; without known lengths: no."""
        bm = self.block_manager
        if bm.null_block is not None or len(bm.windows) != 1:
            return False
        limit = bm.num_usable_blocks - self.admission.watermark_blocks - num_blocks
        used = bm.num_usable_blocks - bm.num_free_blocks
        rate = 1 + self.max_drafts  # tokens a decode adds a step, at most
        lines = []  # (last step, tokens now, most tokens, blocks held, blocks it frees)
        for s in self.running:
            most = self._max_num_tokens.get(s.request_id)
            if most is None:
                return False
            held = bm.held_blocks(s)
            shared = self._shared_leading_blocks(s)  # they stay taken when it ends
            end = most - s.num_tokens if s.num_uncomputed_tokens <= 1 else math.inf
            lines.append((end, s.num_tokens, most, held, held - shared))
        for step in sorted({0, *(end for end, *_ in lines)}):
            total = used
            for end, tokens, most, held, freed in lines:
                if end < step:  # done: its blocks are back (its growth with them)
                    total -= freed
                elif step:
                    total += max(0, bm.blocks_for(min(tokens + rate * step, most)) - held)
                else:
                    total += max(0, bm.blocks_for(tokens) - held)  # the rest of a prompt
            if total > limit:
                return False
        return True

    def _shared_leading_blocks(self, seq: Sequence) -> int:
        """Leading blocks of `seq`'s table another live sequence also holds (a shared
        prefix: they stay cached when `seq` is preempted or ends)."""
        blocks, table = self.block_manager.blocks, seq.block_table
        return next((i for i, b in enumerate(table) if blocks[b].ref_count < 2), len(table))

    def _head(
        self, cand: Candidate, cost: int, available: int, quick_blocks: int
    ) -> HeadReservation:
        """`cand`'s reservation against the running sequences' known ends."""
        bm, releases = self.block_manager, []
        for s in self.running:
            step = self._step_tokens(s) if bm.null_block is not None else None
            held = max(bm.held_blocks(s), bm.footprint(self._reserve(s), step))
            limit = self._max_num_tokens.get(s.request_id)
            final = max(held, bm.footprint(limit, step) if limit else 0)
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

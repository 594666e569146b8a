"""Starting waiting sequences (the second half of a step's plan, after the running ones):
the ready candidates with their prefix-cache matches, the admission policy's order and
reservations, each one's first chunk within the step's token and tower room.

`WaitingAdmission` is a part of `scheduler.planner.Scheduler`, kept in its own module:
its methods read and change the scheduler state annotated below.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.admission import AdmissionPolicy, Candidate
from scheduler.config import SchedulerConfig
from scheduler.encoder_budget import needs_tower
from scheduler.kv_blocks import BlockManager
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.spans import span_safe_end, span_safe_prefix
from scheduler.step_plan import ScheduledSeq, schedule_item


@dataclass
class _Room:
    """What is left of the step being planned: dense tokens, tower tiles spent, and the
    prefill tokens sequences not admitted as quick may still take (None: no cap)."""

    tokens: int
    tiles_used: int
    lump_tokens: int | None


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
    _is_cached: Callable[[ImagePlaceholder], bool]
    _cut_for_tiles: Callable[[Sequence, int, int, int], tuple[int, int]]

    def _candidates(self) -> list[tuple[Candidate, list[int]]]:
        """Ready waiting sequences, each with its prefix-cache match (blocks)."""
        bm, out = self.block_manager, []
        for seq in self.waiting:
            # (Preempted while its last token is in flight: that token is unknown yet.)
            if not seq.ready or seq.num_pending_tokens:
                continue
            hashes = extend_block_hashes(seq, seq.num_tokens, self.block_size)
            # Keep at least one token to compute: its logits give the next token.
            matched = bm.match_prefix(hashes)[: (seq.num_tokens - 1) // self.block_size]
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
            out.append((Candidate(seq, quick, aged), matched))
        return out

    def _admit(self, room: _Room, quick_only: bool = False) -> list[ScheduledSeq]:
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
        matches = {id(c.seq): m for c, m in found}
        blocked: tuple[Candidate, int] | None = None  # an aged candidate that did not fit
        for cand in policy.order([c for c, _ in found]):
            seq = cand.seq
            if room.tokens <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            matched = matches[id(seq)]
            cost = bm.cost_of(matched, self._reserve(seq))
            if blocked is not None and not policy.may_pass(*blocked, cand, cost, quick_blocks):
                continue
            num_cached = len(matched) * self.block_size
            lump_tokens = room.lump_tokens
            step_room = (
                room.tokens if cand.quick or lump_tokens is None else min(room.tokens, lump_tokens)
            )
            chunk = self._first_chunk(seq, num_cached, step_room, room.tiles_used)
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
            room.tokens -= num_new
            available -= cost
            if cand.quick:
                quick_blocks += cost
            elif room.lump_tokens is not None:
                room.lump_tokens -= num_new
        return scheduled

    def _first_chunk(
        self, seq: Sequence, num_cached: int, room: int, tiles_used: int
    ) -> tuple[int, int] | None:
        """(tokens, tiles) of the first chunk of a waiting sequence given `room` tokens
        this step, or None when it cannot start this step (chunking off, no tower room)."""
        todo = seq.num_tokens - num_cached
        num_new, tiles = min(todo, room), 0
        chunked = self.config.enable_chunked_prefill
        if num_new <= 0 or (num_new < todo and not chunked):  # (< 0: an image took the room)
            return None
        if seq.images:
            end, tiles = self._cut_for_tiles(seq, num_cached, num_cached + num_new, tiles_used)
            if end == num_cached or (end < num_cached + num_new and not chunked):
                return None
            num_new = end - num_cached
        if seq.spans:  # never half an image (scheduler/spans.py)
            num_new = span_safe_end(seq.spans, num_cached, num_cached + num_new) - num_cached
        return num_new, tiles

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

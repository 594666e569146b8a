"""Admission policy: which waiting sequence may start, in which order, with what
reservation, and which running sequence gives way when the pool runs dry.

Two policies. `FcfsAdmission` is the baseline: arrival order, the whole prompt reserved
(after prefix-cache hits) plus a watermark, no overtaking, the newest running sequence
preempted. `LumpyAdmission` (article §17, "cache pressure arrives in lumps"):

- reservation: the exact prompt (text + visual tokens) plus the expected decode growth,
  min(max_tokens, decode_reserve_tokens), plus the watermark. Running sequences keep
  their reservation until they have grown into it, so admitted lumps never collide.
- hysteresis: a sequence is preempted only when the pool has no block left for a running
  one; it comes back only when its whole lump plus its growth plus the watermark are
  free after every running reservation. The band between the two thresholds is what
  keeps a burst of image requests from thrashing.
- order: quick requests first (no tower work: images in the encoder or prefix cache, or
  no images; and a prefill that fits one step), then the rest, each by arrival. A
  request that does not fit is skipped, so a later one may start, until it has waited
  `max_wait_steps`: then it goes first and nobody behind it starts until it fits.
- headroom: a share of the pool that only quick requests may take. A non-quick request
  starts only if, after it, the part of that share quick sequences do not already hold is
  still free: `lump_headroom` of the pool without TTFT targets (quick-first order has
  nothing else to keep text moving through a burst of lumps). With targets, the deadline
  order and the head reservation do that, and the headroom is what quick requests have
  lately held, at most that share: a high-water mark of the KV running quick sequences
  hold and have reserved, decaying by `QUICK_DEMAND_DECAY` an admission pass (30% kept
  idle for text that holds 8% of the pool costs images a fifth of it when it binds).
  Quick requests may pass an aged lump that does not fit while they stay inside the
  share: that leaves the lump's own condition unchanged, so the aging bound still holds
  (a lump too big to leave the share free gets a smaller one).
- prefill cap: while a quick request is running or ready to start, at most
  `lump_prefill_tokens` prefill tokens a step go to non-quick sequences, so a step that
  carries a lump stays short for it (the planner applies it). With no quick request in
  the system the lumps take the whole step budget, as an image-only batch wants: a text
  request arriving then waits for at most the one step in flight.
- yield: a step that carries a quick request's first-token work (it starts one, or
  continues one's prefill) gives non-quick sequences no prefill rows, no tower work and no
  start (`yields_to_quick`; the planner applies it), so the text request's first token does
  not wait on a lump's chunk or a 13-tile tower pass in its own step. Never two steps
  running, so lumps keep at least every other step. In that step an aged lump counts as
  not fitting: quick requests pass it only inside the headroom, which leaves its condition
  as it was, so it starts at most one step later than it would have.
- slack (with TTFT targets, `SloConfig`): after the aged ones, least slack against the
  class's target first among those that can still meet it, then the late ones by arrival
  (late: past the target, or, with a step-cost model, with less slack than its prefill
  alone takes). The aging bound holds: with targets its clock starts at the deadline, and
  an aged request goes first whatever its slack.
- head reservation (with TTFT targets; EASY backfilling, Lifka 1995, on the KV pool): the
  first request in the slack order that does not start while it can still make its
  target becomes the head. The running sequences' known lengths (max_tokens) say at which
  step enough blocks for it will be free (the shadow step) and how many will be free then
  beyond its need (the extra). A later request may start only if that cannot delay the
  head: it fits in the extra (which it then uses up, as does each request that can still
  make its target and does not start: those ahead of it come first), or it is done and
  its blocks are back before the shadow step, or it is quick and stays inside the
  headroom (as past an aged lump). Once the head has less than half its target left (the
  urgency at which quick requests bring the caps back) nobody passes it. So text passes a
  waiting image only where the image could not use the room anyway, and not at all when
  it is close to missing; once the pool binds, requests go in slack (≈ arrival) order.
- victim: the running sequence whose preemption throws away the least computed KV not
  kept by the prefix cache (`recompute_cost`), newest first among equals (§19).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as SeqList
from dataclasses import dataclass
from typing import Protocol

from scheduler.sequence import Sequence

# Per admission pass (a step with requests waiting): a high-water mark of the quick
# requests' KV halves in ~350 passes (seconds at 10-30 ms a step), so a burst of text keeps
# its room for a while after it and a quiet spell hands the room to lumps.
QUICK_DEMAND_DECAY = 1 - 1 / 512


@dataclass(frozen=True)
class Candidate:
    """A ready waiting sequence as the policy sees it this step."""

    seq: Sequence
    quick: bool  # no tower work and its prefill fits one step's token budget
    aged: bool  # waited max_wait_steps: goes ahead of every later arrival
    # Seconds until its TTFT target passes (negative: missed); None: no target or clock.
    slack_s: float | None = None


class AdmissionPolicy(Protocol):
    watermark_blocks: int  # kept free of reservations (running sequences grow into it)
    # Prefill tokens a step may give non-quick sequences; None: no cap.
    lump_prefill_tokens: int | None
    # Whether non-quick sequences sit out a step that carries a quick first token.
    yields_to_quick: bool

    def order(self, candidates: list[Candidate]) -> list[Candidate]:
        """Candidates (waiting-queue order) in the order they should be tried."""
        ...

    def may_overtake(self, blocked: Candidate) -> bool:
        """Whether later candidates may still start when `blocked` does not fit."""
        ...

    def reserve_tokens(self, seq: Sequence, max_num_tokens: int | None) -> int:
        """Tokens of KV a sequence holds a reservation for (at least `seq.num_tokens`)."""
        ...

    def can_admit(
        self, cand: Candidate, blocks_needed: int, blocks_available: int, quick_blocks: int
    ) -> bool:
        """Whether `cand` may start; `blocks_available` already excludes reservations,
        `quick_blocks` are held or reserved by running sequences admitted as quick."""
        ...

    def required_blocks(self, cand: Candidate, blocks_needed: int, quick_blocks: int) -> int:
        """The fewest available blocks with which `can_admit` lets `cand` start."""
        ...

    def reserves_for(self, cand: Candidate) -> bool:
        """Whether `cand`, not starting, becomes the head later ones must not delay
        (`HeadReservation`)."""
        ...

    def observe_quick_demand(self, num_blocks: int) -> None:
        """Blocks running quick sequences hold or have reserved, this admission pass."""
        ...

    def may_pass(
        self, blocked: Candidate, blocked_needs: int, cand: Candidate, cand_needs: int,
        quick_blocks: int,
    ) -> bool:  # fmt: skip
        """Whether `cand` may start although `blocked` (aged, needing `blocked_needs`
        blocks) did not fit, without delaying it."""
        ...

    def victim(
        self, others: SeqList[Sequence], current: Sequence, cost: Callable[[Sequence], int]
    ) -> Sequence:
        """Who loses its KV so `current` can grow: one of `others` (running, not yet
        scheduled this step) or `current` itself."""
        ...


def _slack_key(c: Candidate) -> tuple[bool, bool, float, int]:
    assert c.slack_s is not None
    missed = c.slack_s < 0
    return (not c.aged, c.aged or missed, 0.0 if c.aged or missed else c.slack_s, c.seq.arrival)


def reserved_tokens(
    num_tokens: int,
    num_prompt_tokens: int,
    max_num_tokens: int | None,
    decode_reserve: int,
    max_reservable: int,
) -> int:
    """Prompt plus the expected decode growth, min(max new tokens, decode_reserve), but
    no more than the pool can ever reserve (`max_reservable` tokens: a request that fits
    must stay admissible) and never less than what the sequence already holds."""
    target = num_prompt_tokens + decode_reserve
    if max_num_tokens is not None:
        target = min(target, max_num_tokens)
    return max(num_tokens, min(target, max_reservable))


def watermark_blocks(num_blocks: int, watermark: float) -> int:
    return int(num_blocks * watermark)


class FcfsAdmission:
    """Arrival order; stops at the first sequence that does not fit (no overtaking, so a
    large image prompt is never starved by a stream of small ones)."""

    lump_prefill_tokens: int | None = None
    yields_to_quick: bool = False

    def __init__(self, num_blocks: int, watermark: float) -> None:
        self.watermark_blocks = watermark_blocks(num_blocks, watermark)

    def order(self, candidates: list[Candidate]) -> list[Candidate]:
        return candidates

    def may_overtake(self, blocked: Candidate) -> bool:
        return False

    def reserve_tokens(self, seq: Sequence, max_num_tokens: int | None) -> int:
        return seq.num_tokens

    def can_admit(
        self, cand: Candidate, blocks_needed: int, blocks_available: int, quick_blocks: int
    ) -> bool:
        return blocks_available >= self.required_blocks(cand, blocks_needed, quick_blocks)

    def required_blocks(self, cand: Candidate, blocks_needed: int, quick_blocks: int) -> int:
        return blocks_needed + self.watermark_blocks

    def reserves_for(self, cand: Candidate) -> bool:
        return False  # nobody passes anyway

    def observe_quick_demand(self, num_blocks: int) -> None:
        pass  # no headroom

    def may_pass(
        self, blocked: Candidate, blocked_needs: int, cand: Candidate, cand_needs: int,
        quick_blocks: int,
    ) -> bool:  # fmt: skip
        return False

    def victim(
        self, others: SeqList[Sequence], current: Sequence, cost: Callable[[Sequence], int]
    ) -> Sequence:
        return max(others, key=lambda s: s.arrival) if others else current


class LumpyAdmission(FcfsAdmission):
    """Lump reservation with hysteresis, quick-first order with an aging bound, a headroom
    only quick requests take, a per-step prefill cap on lumps, lumps yielding a quick
    request's first step, and the cheapest-recompute victim (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float,
        decode_reserve_tokens: int,
        headroom: float = 0.0,
        lump_prefill_tokens: int | None = None,
        yields_to_quick: bool = False,
    ) -> None:
        super().__init__(num_blocks, watermark)
        self.yields_to_quick = yields_to_quick
        self.decode_reserve_tokens = decode_reserve_tokens
        self.usable_blocks = num_blocks - self.watermark_blocks
        self.max_reservable_tokens = self.usable_blocks * block_size
        self.headroom_blocks = int(num_blocks * headroom)
        # Until quick requests have been seen, the whole configured headroom.
        self.quick_demand_blocks = float(self.headroom_blocks)
        self.lump_prefill_tokens = lump_prefill_tokens

    def observe_quick_demand(self, num_blocks: int) -> None:
        """Blocks running quick sequences hold or have reserved now (each admission
        pass): the headroom follows their decaying high-water mark."""
        self.quick_demand_blocks = max(
            float(num_blocks), self.quick_demand_blocks * QUICK_DEMAND_DECAY
        )

    def lump_headroom(self, blocks_needed: int) -> int:
        """Blocks a non-quick request needing `blocks_needed` must leave for quick ones:
        the headroom (the quick requests' recent high-water mark, at most the configured
        share), shrunk so that a lump that fits the pool can still start."""
        headroom = min(self.headroom_blocks, math.ceil(self.quick_demand_blocks))
        return min(headroom, max(0, self.usable_blocks - blocks_needed))

    def required_blocks(self, cand: Candidate, blocks_needed: int, quick_blocks: int) -> int:
        need = blocks_needed + self.watermark_blocks
        if cand.quick:
            return need
        # Quick sequences already inside the headroom use it: only the rest stays free.
        return need + max(0, self.lump_headroom(blocks_needed) - quick_blocks)

    def reserves_for(self, cand: Candidate) -> bool:
        # Only with targets, and only for a request that can still make its own: a late
        # one is served after those that can (the slack order), or first once aged.
        return cand.slack_s is not None and cand.slack_s >= 0 and not cand.aged

    def may_pass(
        self, blocked: Candidate, blocked_needs: int, cand: Candidate, cand_needs: int,
        quick_blocks: int,
    ) -> bool:  # fmt: skip
        # Inside the headroom a quick start lowers both sides of the lump's condition
        # by the same amount; an aged quick request that does not fit means the pool is
        # full, and nobody passes it.
        if blocked.quick or not cand.quick:
            return False
        return quick_blocks + cand_needs <= self.lump_headroom(blocked_needs)

    def order(self, candidates: list[Candidate]) -> list[Candidate]:
        # Aged first (by arrival). Then, with TTFT targets, least slack first among those
        # that can still meet theirs, then those that missed it (by arrival): a request
        # already late cannot be saved by going first, and going first would make others
        # late too. Without targets: quick, then the rest; arrival breaks ties.
        if candidates and all(c.slack_s is not None for c in candidates):
            return sorted(candidates, key=_slack_key)
        return sorted(candidates, key=lambda c: (not c.aged, c.aged or not c.quick, c.seq.arrival))

    def may_overtake(self, blocked: Candidate) -> bool:
        return not blocked.aged

    def reserve_tokens(self, seq: Sequence, max_num_tokens: int | None) -> int:
        return reserved_tokens(
            seq.num_tokens, seq.num_prompt_tokens, max_num_tokens,
            self.decode_reserve_tokens, self.max_reservable_tokens,
        )  # fmt: skip

    def victim(
        self, others: SeqList[Sequence], current: Sequence, cost: Callable[[Sequence], int]
    ) -> Sequence:
        return min([*others, current], key=lambda s: (cost(s), -s.arrival))


@dataclass
class HeadReservation:
    """The head's reservation (EASY backfilling on the KV pool, see the module docstring):
    `shadow_steps` steps from now (this one counted) enough blocks are back for it, with
    `extra_blocks` beyond its need; inf / 0 where the running sequences' lengths are not
    all known. Steps are the clock: a running sequence adds one token a step."""

    cand: Candidate
    blocks_needed: int
    shadow_steps: float
    extra_blocks: int

    def admits(self, final_blocks: int, lifetime_steps: float) -> bool:
        """Whether a request that will hold at most `final_blocks` and be done within
        `lifetime_steps` (this one counted) may start now without delaying the head; one
        admitted by the extra uses it up."""
        if final_blocks <= self.extra_blocks:
            self.extra_blocks -= final_blocks
            return True
        # Its blocks are free for the plan of step lifetime + 1, the head's at shadow + 1.
        return lifetime_steps <= self.shadow_steps

    def queue_behind(self, num_blocks: int) -> None:
        """A later request that can still make its target did not start either: the
        extra is its first (conservative backfilling for those behind the head, so the
        second image of a burst is not left to wait for what text took)."""
        self.extra_blocks = max(0, self.extra_blocks - num_blocks)


def head_reservation(
    cand: Candidate,
    blocks_needed: int,
    required: int,
    available: int,
    releases: list[tuple[float, int, int]],
) -> HeadReservation:
    """The head's reservation given the `required` available blocks it needs, the
    `available` ones now, and per running sequence (steps until it finishes, blocks it
    frees then, blocks it will still take from the pool before: growth past its
    reservation). The shadow is the earliest step the head could start (growth not
    counted: a backfill must be gone even then); the extra is the fewest blocks free
    beyond the head's need at that step (all growth counted)."""
    free, shadow = available, 0.0
    growth = sum(g for _, _, g in releases)
    for steps, freed, _ in sorted(releases):
        if free >= required:
            break
        if math.isinf(steps):  # an unknown length: no shadow to backfill against
            return HeadReservation(cand, blocks_needed, 0.0, 0)
        free, shadow = free + freed, steps
    if free < required:  # not even with the pool empty (the watermark, the headroom)
        return HeadReservation(cand, blocks_needed, 0.0, 0)
    return HeadReservation(cand, blocks_needed, shadow, max(0, free - growth - required))

"""The budgets of the step being planned (`Room`) and the SLO arithmetic the planner
plans with: a waiting request's slack against its class's TTFT target, whether a quick
request is urgent enough to need the lump caps, and a lump's chunk sized by the TPOT guard.
Pure: the planner owns the sequences and passes what these need."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.config import SchedulerConfig, SloConfig, request_class
from scheduler.lump_budget import (
    TPOT_MARGIN,
    URGENT_SLACK_SHARE,
    LumpAllowance,
    LumpBudget,
    StepCost,
    StepShape,
    TpotGuard,
    add_shapes,
    chunk_shape,
    largest_chunk,
)
from scheduler.sequence import Sequence


@dataclass
class Room:
    """What is left of the step being planned: dense tokens, tower tiles spent, the
    prefill tokens sequences not admitted as quick may still take (None: no cap), the
    step's tile budget (None: none), the TPOT guard (None: off) and the lump tokens it
    can never refuse (what the caps would give: lumps always progress)."""

    tokens: int
    tiles_used: int
    lump_tokens: int | None
    tile_budget: int | None = None
    guard: TpotGuard | None = None
    lump_floor: int = 0
    capped: bool = True  # the quick requests' caps are fully on: lumps may yield

    def room_for(self, lump: bool) -> int:
        """Tokens a chunk may take: lumps also within their allowance."""
        if lump and self.lump_tokens is not None:
            return min(self.tokens, self.lump_tokens)
        return self.tokens

    def spend(self, start: int, num_new: int, tiles: int, lump: bool, decode: bool) -> None:
        """Book a chunk of `num_new` rows after `start` computed tokens (tiles are booked
        by the caller as it cuts chunks)."""
        self.tokens -= num_new
        if lump:
            self.lump_floor = max(0, self.lump_floor - num_new)
            if self.lump_tokens is not None:
                self.lump_tokens -= num_new
        if self.guard is not None:
            self.guard.add(start, num_new, tiles, decode)


def tpot_limit_s(
    running: list[Sequence], tpot_s: float | None, clock: Callable[[], float] | None
) -> float | None:
    """The longest the next step may take (by the step-cost model) so that every decode
    in it keeps its mean time per output token since its first token within
    `TPOT_MARGIN` of the TPOT target: a decode with n output tokens, its first at f, may
    wait TPOT_MARGIN·target·n − (now − f) for its next. The target is on that mean, as
    the SLO counts it; a per-step limit of TPOT_MARGIN·target (what this gives a decode
    that has just sampled its first token, and any without a recorded first token) holds
    every step to the rate only the slowest needs, and makes the lumps' chunks smaller
    than they need be. None without a target or a clock."""
    if tpot_s is None or clock is None:
        return None
    now, limit = clock(), math.inf
    for s in running:
        if s.num_uncomputed_tokens > 1 or s.num_output_tokens == 0:
            continue  # not decoding: no TPOT at stake in this step
        if s.first_token_time is None:
            return TPOT_MARGIN * tpot_s
        budget = TPOT_MARGIN * tpot_s * s.num_output_tokens - (now - s.first_token_time)
        limit = min(limit, budget)
    return limit if math.isfinite(limit) else None


def make_lump_budget(config: SchedulerConfig, cap_tokens: int | None) -> LumpBudget | None:
    """The adaptive lump budget of lumpy admission (None under FCFS: no lump caps)."""
    if config.admission != "lumpy":
        return None
    return LumpBudget(
        cap_tokens, config.encoder_tiles_per_step, config.max_num_batched_tokens,
        config.lump_release_steps,
    )  # fmt: skip


def new_room(
    config: SchedulerConfig,
    budget: LumpBudget | None,
    cap_tokens: int | None,
    step_cost: StepCost | None,
    caps_wanted: Callable[[bool], tuple[bool, bool]],
    tpot_limit: float | None = None,
    window: int | None = None,
) -> Room:
    """The budgets of a step: under lumpy admission (`budget`) this step's lump allowance,
    asking `caps_wanted(guarded)` whether a quick request needs the caps now and whether this
    step suspends them (`caps_suspended`), and the TPOT
    guard where a target and a step-cost model are given (`window`: the model's sliding
    window, for the guard's shapes)."""
    tokens, tile_cap = config.max_num_batched_tokens, config.encoder_tiles_per_step
    if budget is None:
        return Room(tokens, 0, None, tile_cap)
    guard, tpot = None, config.slo.tpot_s
    if step_cost is not None and tpot is not None and config.enable_chunked_prefill:
        limit = tpot * TPOT_MARGIN if tpot_limit is None else tpot_limit
        guard = TpotGuard(step_cost, limit, window)
    needed, suspended = caps_wanted(guard is not None)
    allowance = budget.next_step(needed)
    if suspended:  # the hysteresis keeps counting; this step has no caps
        allowance = LumpAllowance(None, None, False)
    return Room(
        tokens, 0, allowance.tokens, allowance.tiles, guard, cap_tokens or 0, allowance.capped
    )


def slack_s(
    seq: Sequence, slo: SloConfig, now: float | None, prefill_s: float = 0.0
) -> float | None:
    """Seconds until `seq` misses its class's TTFT target; None without one or a clock.
    A request whose prefill alone (`prefill_s`) outlasts its slack can no longer make it:
    its slack is then lowered below zero, so it is ordered with the late ones."""
    target = slo.ttft_for(request_class(len(seq.images)))
    if target is None or now is None or seq.arrival_time is None:
        return None
    slack = seq.arrival_time + target - now
    return slack - prefill_s if 0 <= slack < prefill_s else slack


class PrefillTime:
    """Seconds a prefill takes by the step-cost model, in whole-budget steps that also
    carry the running decodes (`num_decodes` rows reading `decode_kv` tokens of KV), as
    its chunks do: what tells whether a request can still make its TTFT target. 0
    without a model or before it can price a step (the engine's until its first fit).
    `window`: the model's sliding window; `decode_kv_in_window` the decodes' KV within it."""

    def __init__(
        self, step_cost: StepCost | None, step_tokens: int, num_decodes: int, decode_kv: int,
        window: int | None = None, decode_kv_in_window: int = 0,
    ) -> None:  # fmt: skip
        self.step_cost, self.num_decodes, self.decode_kv = step_cost, num_decodes, decode_kv
        self.window, self.decode_kv_in_window = window, decode_kv_in_window
        self.rows = max(1, step_tokens - num_decodes)  # prefill rows a step leaves

    def __call__(self, num_computed: int, num_uncomputed: int) -> float:
        if self.step_cost is None or num_uncomputed <= 0:
            return 0.0
        full, rest = divmod(num_uncomputed, self.rows)
        n, seconds = self.rows, 0.0
        if full:  # whole-budget chunks, their pairs and KV priced at their mean start
            seconds += full * self._chunk_s(num_computed + (full - 1) * n // 2, n)
        if rest:
            seconds += self._chunk_s(num_computed + full * n, rest)
        return seconds if math.isfinite(seconds) else 0.0

    def _chunk_s(self, start: int, n: int) -> float:
        assert self.step_cost is not None
        d, kv = self.num_decodes, self.decode_kv
        chunk = chunk_shape(start, n, 0, False, self.window)
        kv_w = None if self.window is None else self.decode_kv_in_window
        decodes = StepShape(0, d, kv, kv, 0, d, kv_w, kv_w)  # a decode row's pairs: its KV
        return self.step_cost(add_shapes(chunk, decodes))


def is_urgent(seq: Sequence, slo: SloConfig, now: float | None) -> bool:
    """Whether a quick request waiting for its first token needs the lump caps: without a
    TTFT target always; with one, once it has less than `URGENT_SLACK_SHARE` of it left."""
    slack = slack_s(seq, slo, now)
    target = slo.ttft_for(request_class(len(seq.images)))
    return slack is None or target is None or slack < URGENT_SLACK_SHARE * target


def caps_suspended(wanting: list[float | None], lump_slacks: list[float | None]) -> bool:
    """Whether a step goes without the lump caps (and the yield) because they would invert
    the slack order: some lump they hold back (`lump_slacks`: prefilling, or waiting and
    not quick) can still make its TTFT target and has less slack than every quick
    request that wants them (`wanting`; none: the hysteresis alone holds them). Capping
    it delays the request the order serves first; a waiting one also blocks the quick
    request itself (nobody passes an urgent head), so the caps would hold back both. Late
    lumps (negative slack) are served after the rest anyway. False without targets."""
    at_stake = [s for s in lump_slacks if s is not None and s >= 0]
    if not at_stake or any(s is None for s in wanting):
        return False
    return min(wanting, default=math.inf) >= min(at_stake)


def size_chunk(
    start: int,
    todo: int,
    max_new: int,
    chunked: bool,
    cut: Callable[[int], tuple[int, int]],
    room: Room,
    lump: bool,
) -> tuple[int, int] | None:
    """(tokens, tiles) of the next chunk of a sequence with `todo` tokens left from
    `start`, given `max_new` tokens of room: `cut(n)` stops it before an image past the
    step's tile budget, and a lump's is then sized by the TPOT guard. None when nothing
    can run this step (no room, no tower room, or a cut prompt with chunking off)."""
    num_new = min(todo, max_new)
    if num_new <= 0 or (num_new < todo and not chunked):
        return None
    num_new, tiles = cut(num_new)
    if num_new == 0 or (num_new < min(todo, max_new) and not chunked):
        return None
    if lump and room.guard is not None:
        num_new, tiles = guarded_chunk(room, start, num_new, cut)
    return (num_new, tiles) if num_new > 0 else None


def guarded_chunk(
    room: Room, start: int, max_new: int, cut: Callable[[int], tuple[int, int]]
) -> tuple[int, int]:
    """(tokens, tiles) of a lump's chunk of at most `max_new` tokens from `start` that
    keeps the step under the TPOT guard, never less than the caps' share
    (`room.lump_floor`); `cut(n)`: the (tokens, tiles) a chunk of n tokens cuts to."""
    guard = room.guard
    assert guard is not None
    return largest_chunk(
        max_new, room.lump_floor, cut, lambda n, tiles: guard.fits(start, n, tiles)
    )

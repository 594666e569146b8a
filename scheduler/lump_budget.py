"""The adaptive lump budget: how many prefill tokens and tower tiles a step gives the
sequences not admitted as quick (lumps), and the TPOT guard that sizes a step's prefill so
the decodes riding in it stay under their target.

The per-step caps (`lump_prefill_tokens_per_step`, `encoder_tiles_per_step`) exist to keep
steps short for quick requests. They cost the lumps throughput, so they apply only while
a quick request needs them: one waits to start or for its first token, or one decodes and
no TPOT guard can say how long a step may be. Otherwise the lumps get the whole token and
tower budget, bounded by the TPOT guard when one is configured.

Hysteresis: a quick request needing the caps brings them back in the same step; they are
lifted only after `release_steps` steps without one, and then the lumps' share doubles
each quiet step (cap, 2·cap, 4·cap, … up to the whole budget), so a quick request every
other step keeps the caps on and a quiet spell opens the budget within a few steps.

No torch, no clock: the step-cost model is injected (`StepCost`, a plain callable the
engine fits online and the simulator takes from its roofline or measured fit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from scheduler.sequence import Sequence
from scheduler.step_plan import StepPlan

# The guard plans steps to this share of the TPOT target: the step-cost model is a fit, and
# a request's TPOT also takes the steps that start quick requests.
TPOT_MARGIN = 0.9
# With a TTFT target, a quick request needs the caps (and the yield) only once it has used
# half of its target waiting: before that, it starts with whatever room the lumps leave,
# which at most a few steps of a whole-budget lump delay.
URGENT_SLACK_SHARE = 0.5


class StepShape(NamedTuple):
    """The work of one step, as a step-cost model prices it (the fields of
    `search.sim.step_time.StepWork`, in its order)."""

    num_prefill_tokens: int = 0
    num_decode_rows: int = 0
    num_attention_pairs: int = 0  # Σ over chunks of rows · (computed + rows)
    num_kv_tokens_read: int = 0  # Σ over scheduled sequences of their context after the step
    num_tiles_encoded: int = 0
    num_seqs: int = 0
    # A sliding-window model's (Gemma 3): the KV and pairs above clipped to its window,
    # counted as StepWork counts them (None: no window, or not counted).
    num_kv_tokens_read_in_window: int | None = None
    num_attention_pairs_in_window: int | None = None


def sliding_window(windows: tuple[int | None, ...]) -> int | None:
    """The sliding window of a model's KV cache groups (`BlockManager.windows`); None
    without one (a model's sliding layers share one window: Gemma 3)."""
    return next((w for w in windows if w is not None), None)


# Seconds a step of this shape takes (the engine's online fit, the simulator's model).
StepCost = Callable[[StepShape], float]


def chunk_shape(
    num_computed: int, num_new: int, num_tiles: int, decode: bool, window: int | None = None
) -> StepShape:
    """One sequence's share of a step: `num_new` rows after `num_computed` tokens (with a
    `window`: its sliding layers' rows each priced at min(context, window) keys)."""
    context = num_computed + num_new
    in_window = (None, None) if window is None else (min(context, window),) * 2
    return StepShape(
        0 if decode else num_new, num_new if decode else 0, num_new * context, context,
        num_tiles, 1, in_window[0], None if window is None else num_new * in_window[1],
    )  # fmt: skip


def plan_shape(plan: StepPlan, seqs: dict[str, Sequence], window: int | None = None) -> StepShape:
    """The shape of `plan` (before `update`), as the TPOT guard prices one: what the
    engine records for each step it times (`Scheduler.step_shape`)."""
    shape = StepShape()
    for item in plan.scheduled:
        seq, n, start = seqs[item.request_id], item.num_new_tokens, item.num_computed_tokens
        # An image's tower runs in the chunk that reaches its first placeholder.
        tiles = sum(
            max(1, seq.images[c.index].num_tiles) for c in item.images if c.offset_start == 0
        )
        decode = n == 1 and start >= seq.num_prompt_tokens
        shape = add_shapes(shape, chunk_shape(start, n, tiles, decode, window))
    return shape


def add_shapes(a: StepShape, b: StepShape) -> StepShape:
    """The shape of both; a windowed count is None only where neither has it."""
    windowed = (None if x is None and y is None else (x or 0) + (y or 0)
                for x, y in zip(a[6:], b[6:], strict=True))  # fmt: skip
    return StepShape(*(x + y for x, y in zip(a[:6], b[:6], strict=True)), *windowed)


@dataclass(frozen=True)
class LumpAllowance:
    """What lumps may take in the step being planned (None: no cap of that kind)."""

    tokens: int | None
    tiles: int | None
    capped: bool  # the quick requests' caps are fully on


class LumpBudget:
    """The lumps' per-step share with hysteresis (see the module docstring): the caps
    times a scale, 1 while quick requests need them, doubling each quiet step after the
    release, until the share is the whole budget."""

    def __init__(
        self, cap_tokens: int | None, cap_tiles: int | None, full_tokens: int, release_steps: int
    ) -> None:
        assert full_tokens >= 1 and release_steps >= 0, (full_tokens, release_steps)
        self.cap_tokens, self.cap_tiles = cap_tokens, cap_tiles
        self.release_steps = release_steps
        # The scale at which the caps no longer bind: the token cap reaches the step
        # budget (with only a tile cap: three doublings, 8x).
        self.max_scale = -(-full_tokens // cap_tokens) if cap_tokens else 8
        # Nothing has needed the caps yet: an image-only start gets the whole budget.
        self.scale = self.max_scale
        self.num_quiet_steps = release_steps + 1

    def next_step(self, needed: bool) -> LumpAllowance:
        """The allowance of the next step; `needed`: a quick request needs the caps now."""
        if needed:
            self.num_quiet_steps, self.scale = 0, 1
        else:
            self.num_quiet_steps += 1
            if self.num_quiet_steps > self.release_steps:
                self.scale = min(self.max_scale, self.scale * 2)
        if self.scale >= self.max_scale:
            return LumpAllowance(None, None, False)
        tokens = None if self.cap_tokens is None else self.cap_tokens * self.scale
        tiles = None if self.cap_tiles is None else self.cap_tiles * self.scale
        return LumpAllowance(tokens, tiles, self.scale == 1)


class TpotGuard:
    """Keeps a step that carries decodes under a TPOT target: it tracks the shape of the
    step being planned, and a lump chunk may only add what keeps the step's predicted
    time within `limit_s`. Without decode rows in the step nobody's TPOT is at stake."""

    def __init__(self, cost: StepCost, limit_s: float, window: int | None = None) -> None:
        self.cost, self.limit_s, self.window = cost, limit_s, window
        self.shape = StepShape()

    def add(self, num_computed: int, num_new: int, num_tiles: int, decode: bool) -> None:
        chunk = chunk_shape(num_computed, num_new, num_tiles, decode, self.window)
        self.shape = add_shapes(self.shape, chunk)

    def fits(self, num_computed: int, num_new: int, num_tiles: int) -> bool:
        if self.shape.num_decode_rows == 0:
            return True
        chunk = chunk_shape(num_computed, num_new, num_tiles, False, self.window)
        return self.cost(add_shapes(self.shape, chunk)) <= self.limit_s


def largest_chunk(
    max_new: int,
    floor: int,
    chunk: Callable[[int], tuple[int, int]],
    fits: Callable[[int, int], bool],
) -> tuple[int, int]:
    """(tokens, tiles) of the largest chunk of at most `max_new` tokens that `fits`
    (given the tokens and tiles `chunk(n)` cuts to), never less than the chunk of `floor`
    tokens (what the quick requests' caps would give: lumps always progress). `chunk` and
    `fits` must be monotone in n; binary search, ~log2(max_new) evaluations."""
    best = chunk(min(floor, max_new)) if floor > 0 else (0, 0)
    full = chunk(max_new)
    if fits(*full):
        return full
    lo, hi = best[0], max_new  # fits(lo) or lo is the floor; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cut = chunk(mid)
        if fits(*cut):
            lo, best = mid, max(best, cut)
        else:
            hi = mid
    return best

"""Shared helpers for the scheduler tests: tiny configs, requests, a fake runner loop."""

from __future__ import annotations

import itertools

from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.encoder_budget import image_tiles, needs_tower
from scheduler.planner import Scheduler
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.step_plan import StepPlan

_tokens = itertools.count(1000)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    config = {"max_num_batched_tokens": 64, **config}
    return Scheduler(SchedulerConfig(**config), CacheConfig(block_size=block_size), num_blocks)


def make_request(
    request_id: str,
    num_tokens: int,
    images: list[tuple[int, int, int]] = (),
    ready: bool = True,
) -> Sequence:
    """Distinct token ids (no accidental prefix hits); images are (first position,
    number of placeholder tokens, tiles), hashed by request id and index."""
    tokens = [next(_tokens) for _ in range(num_tokens)]
    placeholders = [
        ImagePlaceholder(f"{request_id}/{i}".encode(), list(range(at, at + n)), num_tiles=tiles)
        for i, (at, n, tiles) in enumerate(images)
    ]
    seq = Sequence(request_id, tokens, placeholders)
    seq.ready = ready
    return seq


def run_step(scheduler: Scheduler, limits: dict[str, int]) -> StepPlan:
    """One step with a fake runner: every sampling row emits token 7; a sequence that
    reaches its limit (prompt + output tokens) finishes."""
    plan = scheduler.schedule()
    scheduler.update(plan, [[7] if item.sample else [] for item in plan.scheduled])
    for item in plan.scheduled:
        seq = scheduler.seqs[item.request_id]
        if seq.num_tokens >= limits[seq.request_id]:
            scheduler.finish(seq)
    scheduler.block_manager.check_integrity()
    return plan


def tiles_encoded(scheduler: Scheduler, plan: StepPlan) -> int:
    """Tiles the runner encodes for `plan` (call before `update`): images a chunk reaches
    for the first time since their sequence's admission, not in the encoder cache."""
    total = 0
    for item in plan.scheduled:
        seq = scheduler.seqs[item.request_id]
        start = item.num_computed_tokens
        since = scheduler._admitted_at[seq.request_id]
        for image in seq.images:
            cached = scheduler.encoder_cached(image.content_hash)
            if needs_tower(image, start, start + item.num_new_tokens, since, cached):
                total += image_tiles(image)
    return total


class RefusesOne:
    """Admission with a bug: it never lets request "bad" start, though the arrival check
    took it (fault injection: `check_fits` and the policy are meant to agree)."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    def can_admit(self, cand, *args) -> bool:
        return cand.seq.request_id != "bad" and self.policy.can_admit(cand, *args)

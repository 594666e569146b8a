"""The engine's online step-cost model for the TPOT guard: a plan's shape as the simulator
prices it, and the fit of timed steps (vlmserve/engine/step_cost.py)."""

from __future__ import annotations

import math
import random

from scheduler.lump_budget import StepShape, plan_shape
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.step_plan import ImageChunk, ScheduledSeq, StepPlan
from search.sim.step_time import MeasuredStepCost, StepWork
from vlmserve.engine.step_cost import OnlineStepCost


def test_plan_shape_counts_rows_pairs_and_the_tiles_of_images_first_reached():
    image = ImagePlaceholder(b"x", list(range(4, 12)), num_tiles=3)
    seqs = {
        "img": Sequence("img", list(range(20)), [image]),
        "dec": Sequence("dec", list(range(11)), num_prompt_tokens=10),
    }
    chunk = ImageChunk(0, None, 8, 0, tuple(range(4, 10)), False)
    plan = StepPlan([
        ScheduledSeq("img", 0, 10, False, images=(chunk,)),
        ScheduledSeq("dec", 10, 1, True),
    ])  # fmt: skip
    assert plan_shape(plan, seqs) == StepShape(10, 1, 10 * 10 + 1 * 11, 10 + 11, 3, 2)


def test_online_fit_prices_inf_until_it_has_samples_then_tracks_the_machine():
    truth = MeasuredStepCost(2e-3, 1e-4, 3e-6, 1e-9, 4e-3)
    cost = OnlineStepCost(window=256, refit_every=16, min_samples=32)
    probe = StepShape(300, 20, 300 * 300 + 20 * 500, 10_000, 2, 24)
    assert cost(probe) == math.inf  # no fit yet: the guard lets lumps only their cap
    rng = random.Random(0)
    for _ in range(64):
        prefill, decode, tiles = rng.randint(0, 512), rng.randint(1, 40), rng.randint(0, 4)
        shape = StepShape(prefill, decode, prefill * prefill + decode * 400, 5000, tiles,
                          decode + (prefill > 0))  # fmt: skip
        cost.record(shape, sum(truth.split(StepWork(*shape))))
    expected = sum(truth.split(StepWork(*probe)))
    assert abs(cost(probe) - expected) <= 0.02 * expected

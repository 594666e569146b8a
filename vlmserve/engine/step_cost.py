"""The engine's step-time model for the scheduler's TPOT guard (`--slo-tpot-ms`): the
simulator's `MeasuredStepCost` fitted online (`search.sim.step_time.fit_step_cost`) to the
engine's own recent steps on this machine, refitted as it runs. Until the first fit it
prices every step at infinity: the guard then gives lumps only their capped share, the
behaviour without a target."""

from __future__ import annotations

import math
from collections import deque

from scheduler.lump_budget import StepShape
from search.sim.step_time import MeasuredStepCost, StepWork, fit_step_cost


class OnlineStepCost:
    """A `StepCost` fitted to the last `window` timed steps, every `refit_every` steps."""

    def __init__(self, window: int = 512, refit_every: int = 64, min_samples: int = 32) -> None:
        self.samples: deque[tuple[StepWork, float]] = deque(maxlen=window)
        self.refit_every, self.min_samples = refit_every, min_samples
        self.fit: MeasuredStepCost | None = None
        self._since_fit = 0

    def record(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0 or (shape.num_prefill_tokens + shape.num_decode_rows) == 0:
            return
        self.samples.append((StepWork(*shape), seconds))
        self._since_fit += 1
        if len(self.samples) >= self.min_samples and (
            self.fit is None or self._since_fit >= self.refit_every
        ):
            try:
                self.fit = fit_step_cost(list(self.samples))
            except ValueError:  # degenerate samples: keep the previous fit
                pass
            self._since_fit = 0

    def __call__(self, shape: StepShape) -> float:
        if self.fit is None:
            return math.inf
        vit_s, rest = self.fit.split(StepWork(*shape))
        return vit_s + rest

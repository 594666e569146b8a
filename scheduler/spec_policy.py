"""Adaptive speculation: how many drafts each decoding sequence gets this step.

Two gates, both from the cost model (article §11, §15):
- per step: verifying γ drafts for each of B decodes puts B·(γ+1) rows (plus any prefill
  rows) through every GEMM. While that stays under the ridge B* the extra rows ride on
  the weight read for free; past it every rejected row is real time, so γ shrinks to
  what fits and is 0 once even γ = 1 does not.
- per sequence: with its recent acceptance rate α, pick the γ that maximises the
  speed-up E[tokens](α, γ) / (1 + γ·c); a sequence whose drafts keep failing gets 0,
  and is probed with a single draft every `probe_interval` decode steps after that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.config import SpeculativeConfig

# speed-up(α, γ, c) of speculating γ drafts at acceptance rate α and draft cost c: the cost
# model's `spec_speedup` (search/costmodel), handed in by the engine so that the scheduler
# imports nothing from search.
SpeedupFn = Callable[[float, int, float], float]


@dataclass(frozen=True)
class SpecMetrics:
    num_proposed_tokens: int
    num_accepted_tokens: int
    num_verifications: int  # sequence-steps that verified at least one draft

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_proposed_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verification (the emitted tokens are this + 1)."""
        return self.num_accepted_tokens / max(1, self.num_verifications)


@dataclass
class _Evidence:
    accepted: float = 0.0
    trials: float = 0.0  # Bernoulli trials seen: accepted drafts + the first rejection
    num_steps_off: int = 0


class SpecPolicy:
    def __init__(
        self, config: SpeculativeConfig, ridge_batch: float, speedup: SpeedupFn | None = None
    ) -> None:
        if config.adaptive and speedup is None:
            raise ValueError("adaptive speculation needs the speed-up model (speedup=)")
        self.config = config
        self.ridge_batch = ridge_batch
        self._speedup = speedup
        self._evidence: dict[str, _Evidence] = {}
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0

    def step_gamma(self, num_decodes: int, num_other_rows: int = 0) -> int:
        """The largest γ ≤ γ_max with num_decodes·(γ+1) + num_other_rows ≤ B*."""
        gamma_max = self.config.num_speculative_tokens
        if not self.config.adaptive or num_decodes == 0:
            return gamma_max
        room = self.ridge_batch - num_decodes - num_other_rows
        return max(0, min(gamma_max, math.floor(room / num_decodes)))

    def seq_gamma(self, request_id: str, step_gamma: int) -> int:
        """γ for one decoding sequence this step (call once per decode step: it counts
        the steps a switched-off sequence waits for its next probe)."""
        if not self.config.adaptive or step_gamma == 0:
            return step_gamma
        alpha, cost = self.acceptance_rate(request_id), self.config.row_cost
        speedup = self._speedup
        assert speedup is not None
        # Ties go to the smaller γ: no rows spent for nothing.
        gamma = max(range(step_gamma + 1), key=lambda g: (speedup(alpha, g, cost), -g))
        evidence = self._evidence.setdefault(request_id, _Evidence())
        if gamma > 0:
            evidence.num_steps_off = 0
            return gamma
        evidence.num_steps_off += 1
        if evidence.num_steps_off < self.config.probe_interval:
            return 0
        evidence.num_steps_off = 0
        return 1

    def acceptance_rate(self, request_id: str) -> float:
        """Recent α of the sequence, with the prior counted as one trial."""
        evidence = self._evidence.get(request_id, _Evidence())
        prior = self.config.prior_acceptance
        return (evidence.accepted + prior) / (evidence.trials + 1.0)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_proposed, f"{num_accepted} of {num_proposed} accepted"
        if num_proposed == 0:
            return
        evidence = self._evidence.setdefault(request_id, _Evidence())
        decay = self.config.acceptance_decay
        evidence.accepted = decay * evidence.accepted + num_accepted
        evidence.trials = decay * evidence.trials + num_accepted + (num_accepted < num_proposed)
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1

    def drop(self, request_id: str) -> None:
        self._evidence.pop(request_id, None)

    @property
    def metrics(self) -> SpecMetrics:
        return SpecMetrics(
            self.num_proposed_tokens, self.num_accepted_tokens, self.num_verifications
        )

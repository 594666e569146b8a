"""Sampling parameters, per-request sampler state, and the plain-torch reference filter.

Each request draws its uniforms from its own seeded generator, so a request's tokens do
not depend on what else is in the batch (the batching tests rely on this); the batched
sampler that uses them lives in `batch_sampler.py`, `filtered_probs` here is its
one-row reference.

What must stay true: every accepted SamplingParams gives a valid distribution. A
temperature under GREEDY_TEMPERATURE is greedy (dividing logits by 1e-40 overflows to
inf and softmax to NaN); logits are shifted by their max before the division; top-p
always keeps the most likely token, however small top_p is.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from vlmserve.sample.structured import StructuredOutput

# Below this a temperature is treated as 0 (greedy), as vLLM does: the distribution is
# already a point mass on the argmax to float32 precision.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Structured outputs: the output follows this JSON schema / regex / choice / grammar.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class SamplerState:
    """Per-request sampling state: the params and the request's own generator.

    The generator lives on the host even when the logits are on a GPU: a step needs only
    two uniforms per row from it (accept a draft, pick a token), and drawing them here
    costs one cheap Python call per request instead of one device launch per request."""

    params: SamplingParams
    rng: random.Random = field(init=False)
    # Its constraint's vlmserve.sample.grammar.RequestGrammar (None: unconstrained).
    grammar: object = None

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.rng = random.Random(seed)

    def uniforms(self, n: int) -> list[float]:
        """n draws from [0, 1) with 53 random bits each (float64: the inverse-CDF draw
        resolves probabilities far below float32's)."""
        return [self.rng.random() for _ in range(n)]


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p. logits: [vocab] float32. The
    plain-torch reference for `sampling_ops` (which filters every row at once).
    Never NaN for finite logits: the max logit becomes 0 before the division, so a tiny
    temperature sends the others to -inf, not the max to +inf."""
    logits = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        outside = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        outside[0] = False  # a top_p below float32's range (1e-300) would drop them all
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs

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

import collections
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
    # Logit controls (vLLM's definitions; `controls.py` applies them, batched per row).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is taken
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    # Logprobs of each output token and its `logprobs` most likely alternatives (None:
    # off); of each prompt token (`prompt_logprobs`). Raw: log_softmax of the model's
    # float32 logits, before any control or temperature (vLLM's default `raw_logprobs`).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # n answers per prompt; best_of: draw that many and keep the n of highest cumulative
    # logprob. Child i of a seeded request draws with seed + i.
    n: int = 1
    best_of: int | None = None
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
        check_controls(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_logit_controls(self) -> bool:
        """Whether `controls.apply_controls` changes this request's logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens or self.bad_words
        )  # fmt: skip


MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_N = 128


def check_controls(params: SamplingParams) -> None:
    """ValueError naming the first control out of range (normalises logit_bias and
    bad_words to tuples). Ranges as OpenAI's API and vLLM."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise ValueError(f"{name}={value} must be in [-2, 2]")
    rep = params.repetition_penalty
    if not (math.isfinite(rep) and 0.0 < rep <= 100.0):
        raise ValueError(f"repetition_penalty={rep} must be in (0, 100]")
    if not (math.isfinite(params.min_p) and 0.0 <= params.min_p <= 1.0):
        raise ValueError(f"min_p={params.min_p} must be in [0, 1]")
    if params.min_tokens < 0 or params.min_tokens > params.max_tokens:
        raise ValueError(f"min_tokens={params.min_tokens} must be in [0, max_tokens]")
    bias = params.logit_bias
    pairs = tuple(bias.items()) if isinstance(bias, dict) else tuple(tuple(p) for p in bias)
    for token, value in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias: token id {token!r} must be an int >= 0")
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise ValueError(f"logit_bias[{token}]={value} must be in [-100, 100]")
    object.__setattr__(params, "logit_bias", tuple((t, float(v)) for t, v in pairs))
    words = (params.bad_words,) if isinstance(params.bad_words, str) else params.bad_words
    if any(not isinstance(w, str) or not w for w in words):
        raise ValueError("bad_words must be non-empty strings")
    object.__setattr__(params, "bad_words", tuple(words))
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"{name}={value} must be in [0, {MAX_LOGPROBS}]")
    if not 1 <= params.n <= MAX_N:
        raise ValueError(f"n={params.n} must be in [1, {MAX_N}]")
    if params.best_of is not None and not params.n <= params.best_of <= MAX_N:
        raise ValueError(f"best_of={params.best_of} must be in [n={params.n}, {MAX_N}]")


@dataclass
class SamplerState:
    """Per-request sampling state: the params and the request's own generator.

    The generator lives on the host even when the logits are on a GPU: a step needs only
    two uniforms per row from it (accept a draft, pick a token), and drawing them here
    costs one cheap Python call per request instead of one device launch per request."""

    params: SamplingParams
    rng: random.Random = field(init=False)
    # What the logit controls read (`controls.py`), set by the engine: the prompt, the
    # tokens emitted so far (only appended to, by `sample_plan` on the sampling thread),
    # the ids min_tokens holds back, and bad_words as token id sequences.
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # Its row of the penalties' state (`penalty_table.PenaltySlot`), made on its first
    # penalised step; the row is freed when this state is collected.
    penalties: object = None
    # Per sampled step, the logprobs of the tokens it emitted (`logprobs.py`), in step
    # order: the sampling thread appends, the engine thread pops (deque ops are atomic).
    logprobs: collections.deque = field(default_factory=collections.deque)
    # Prompt logprobs as the prefill computes them: (first position, records) per chunk.
    prompt_logprobs: collections.deque = field(default_factory=collections.deque)
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
    """Probabilities after temperature, min_p, top-k and top-p. logits: [vocab] float32. The
    plain-torch reference for `sampling_ops` (which filters every row at once).
    Never NaN for finite logits: the max logit becomes 0 before the division, so a tiny
    temperature sends the others to -inf, not the max to +inf."""
    logits = (logits - logits.max()) / params.temperature
    if params.min_p > 0:  # p < min_p * p_max, i.e. exp(logit - max) < min_p
        logits = logits.masked_fill(logits.exp() < params.min_p, float("-inf"))
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

"""What the engine hands back: per-request outputs, prepared requests, finish reasons.
Records, not live objects: the server and the CLIs read them (`vlmserve.engine.core`
re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vlmserve.inputs.processing import ProcessedPrompt
from vlmserve.sample.logprobs import TokenLogprob
from vlmserve.sample.params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


class StepFailedError(RuntimeError):
    """The engine failed on this request (not on its input): 500. The cause is logged,
    not sent to the client."""

    status = 500


class NeverStartsError(RuntimeError):
    """The scheduler cannot start this request even with nothing else running (its KV or
    its first chunk never fits, though admission accepted it at arrival): a bug, answered
    with 500 rather than waited on forever."""

    def __init__(self, seq) -> None:
        super().__init__(
            f"request {seq.request_id} ({seq.num_tokens} tokens) cannot be scheduled on an "
            "idle engine; admission should have refused it at arrival"
        )


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)  # since the previous step
    text: str = ""  # all of it so far, cut at a stop string
    # Text not handed out before; held back while a stop string could still cut it.
    text_delta: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_status: int | None = None  # HTTP status of `error`: 4xx its input, 5xx ours
    error_type: str | None = None  # the error's class (RequestError subclasses by name)
    num_prompt_tokens: int = 0
    num_image_tokens: int = 0
    num_cached_tokens: int = 0
    # With SamplingParams.logprobs: one record per output token (`sample.logprobs`).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # since the previous step
    cumulative_logprob: float = 0.0
    prompt_token_ids: list[int] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: per prompt position (None at 0: nothing
    # predicts the first token), filled as the prefill runs.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class PreparedRequest:
    """A request after `Engine.prepare`: tokens, image placeholders, checked limits."""

    request_id: str | None
    prompt: ProcessedPrompt
    params: SamplingParams
    max_tokens: int
    # n > 1: the id of the sibling whose prefill this one waits for, to share its prompt's
    # KV blocks through the prefix cache (`request_options`).
    share_prompt_with: str | None = None
    grammar: object = None  # vlmserve.sample.grammar.RequestGrammar (params.structured)

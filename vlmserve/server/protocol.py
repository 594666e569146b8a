"""The OpenAI chat-completions wire format: request and response models, error bodies.

Request models reject unknown shapes with 422 (pydantic); the fields we know but cannot
honour (`best_of` on chat, …) are
refused with 400 naming them in `to_sampling`, whenever they ask for something other than
the default: silently ignoring them would hand back an answer the client did not ask for.
Constraints (`response_format`, `structured_outputs`, `guided_*`) are read in
`constraints.py`, tools in `tools.py`.
Other extra fields (metadata, `user`, `store`, …) are allowed and ignored, so newer
clients keep working.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vlmserve.sample.params import SamplingParams
from vlmserve.server.constraints import structured_of
from vlmserve.server.sampling_fields import SamplingFields

DEFAULT_MAX_TOKENS = 256

# Request fields that change the answer and that the engine does not implement, with the
# values that mean "not used" (sending those is fine).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "best_of": (None, 1),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImageURL(_Open):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Open):
    include_usage: bool = False


class ChatCompletionRequest(SamplingFields, _Open):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    user: str | None = None
    # Extensions (vLLM's names), sent with the client's `extra_body`.
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Each prompt token's logprob and this many alternatives (vLLM's shape, at the top level).
    prompt_logprobs: int | None = Field(default=None, strict=True)

    def to_sampling(self, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
        """SamplingParams for this request; ValueError (400) for what we cannot serve."""
        unsupported = [
            name
            for name, defaults in UNSUPPORTED_FIELDS.items()
            if name in (self.model_extra or {}) and self.model_extra[name] not in defaults
        ]
        if unsupported:
            raise ValueError(f"not supported by this server: {', '.join(unsupported)}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(
                f"prompt_logprobs={self.prompt_logprobs} must be in [0, 20] (vLLM's -1, "
                "the whole vocabulary, is not supported)"
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise ValueError("stop takes at most 4 non-empty strings")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
            **self.control_kwargs(),
            structured=structured_of(self.model_extra or {}),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# --- responses ------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    # Not in OpenAI's schema (clients keep extra fields): the prompt split by modality.
    text_tokens: int = 0
    image_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(
    num_prompt: int, num_image: int, num_cached: int, num_completion: int
) -> dict[str, Any]:
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=num_cached, text_tokens=num_prompt - num_image, image_tokens=num_image
        ),
    ).model_dump()


FinishReason = Literal["stop", "length", "tool_calls"] | None


def completion_body(
    request_id: str,
    model: str,
    text: str,
    finish_reason: FinishReason,
    usage: dict[str, Any],
    message: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The answer; `message` replaces the plain text one (tool calls)."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message or {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage,
    }


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish_reason: FinishReason = None,
    usage: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One SSE chunk of choice `index`. `delta=None` makes the usage-only chunk (no
    choices)."""
    choices = []
    if delta is not None:
        choices = [
            {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        ]
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": status,
        }
    }

"""`POST /v1/completions`: raw prompts (text, token ids, or a list of either) → choices,
`prompt_index * n + i` for choice i of a prompt, as OpenAI and vLLM number them.

`echo` puts the prompt before each choice's text (and, with `logprobs`, the prompt
tokens' logprobs before the output's: lm-eval's loglikelihood); `best_of` > n draws
best_of choices per prompt and keeps the n of highest cumulative logprob (not streamable:
the ranking needs the ends); `suffix` (insertion) is refused with 400.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from scheduler.config import request_class
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.server.chat import (
    Handler,
    _AbortingStream,
    _sse,
    _StreamState,
    _Tracker,
    error_response,
    public_message,
    status_of,
)
from vlmserve.server.choices import Choice, Choices, fan_out, stream_items
from vlmserve.server.constraints import structured_of
from vlmserve.server.engine_loop import Failed
from vlmserve.server.protocol import StreamOptions, error_body, make_usage
from vlmserve.server.sampling_fields import (
    SamplingFields,
    completion_logprobs,
    vllm_logprobs,
)

MAX_PROMPTS = 256  # prompts in one request: each is prepared and queued on its own


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, strict=True)  # `true` is chat's spelling
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, strict=True)  # vLLM's extension
    suffix: str | None = None
    best_of: int | None = None
    user: str | None = None
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def prompts(self) -> list[Request]:
        """One engine request per prompt; ValueError (400) for an empty list."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise ValueError("a prompt must not be empty")
                out.append(Request(prompt=p))
            else:
                out.append(Request(prompt_token_ids=list(p)))
        return out

    def to_sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported by this server (no insertion)")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot stream: the ranking needs every choice's end")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise ValueError("stop takes at most 4 non-empty strings")
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            prompt_logprobs=self._prompt_logprobs(),
            best_of=self.best_of,
            **self.control_kwargs(),
            structured=structured_of(self.model_extra or {}),  # response_format, guided_*
        )

    def _prompt_logprobs(self) -> int | None:
        """vLLM's field, or what echo with logprobs needs (the larger when both)."""
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        wanted = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(wanted) if wanted else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionHandler(Handler):
    async def __call__(self, body: CompletionRequest, http: HTTPRequest) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        track = _Tracker(time.perf_counter(), self.metrics, request_class(0))  # text only
        choices = Choices(self.loop, track.on_snapshot)
        try:
            if body.model is not None and body.model != self.settings.model_name:
                raise _NotFound(f"model {body.model!r} does not exist")
            params = body.to_sampling(self.settings.default_max_tokens)
            width = max(params.n, params.best_of or 0)  # engine requests per prompt
            for p, base in enumerate(body.prompts()):
                rid = request_id if p == 0 and width == 1 else f"{request_id}-p{p}"
                choices.submit(fan_out(base, params, rid, p * width), prompt_index=p)
        except Exception as e:  # mapped to its 4xx/5xx
            choices.abort()
            return self._failed(e)
        failed = await choices.accepted()
        if failed is not None:
            return self._failed(failed.error)
        if body.stream:
            state = _StreamState()
            stream = self._stream(request_id, body, choices, state)
            return _AbortingStream(stream, lambda: self._close(choices, state))
        failed = await choices.complete(http.is_disconnected)
        if failed is not None:
            return self._failed(failed.error)
        ordered = _best(choices.ordered(), params)
        if any(c.last.finish_reason == "abort" for c in ordered):
            return Response(status_code=499)
        out = self._envelope(request_id)
        out["choices"] = [self._choice(body, c, i, choices) for i, c in enumerate(ordered)]
        out["usage"] = _usage(choices.ordered())
        return JSONResponse(out)

    def _failed(self, error: BaseException) -> JSONResponse:
        self.metrics.requests.inc(outcome=f"http_{status_of(error)}")
        return error_response(error)

    def _close(self, choices: Choices, state: _StreamState) -> None:
        if not state.done:
            state.done = True
            choices.abort()
            self.metrics.requests.inc(outcome="abort")

    def _envelope(self, request_id: str) -> dict[str, Any]:
        return {
            "id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": self.settings.model_name, "choices": [], "usage": None,
        }  # fmt: skip

    def _echo(self, body: CompletionRequest, choice: Choice) -> str:
        if not body.echo:
            return ""
        prompt = body.prompts()[choice.prompt_index]
        return (
            prompt.prompt
            if prompt.prompt is not None
            else self.texts.decode(prompt.prompt_token_ids)
        )

    def _choice(
        self, body: CompletionRequest, choice: Choice, index: int, choices: Choices
    ) -> dict[str, Any]:
        echo = self._echo(body, choice)
        logprobs = None
        if body.logprobs is not None:
            logprobs = self._logprobs(body, choice, choices, choice.logprobs)
        out = {
            "index": index, "text": echo + choice.text, "logprobs": logprobs,
            "finish_reason": choice.last.finish_reason,
        }  # fmt: skip
        if body.prompt_logprobs is not None:  # vLLM's shape: per position {id: {...}}
            out["prompt_logprobs"] = self._prompt_logprobs(choices, choice)
        return out

    def _prompt_logprobs(self, choices: Choices, choice: Choice) -> list[dict | None]:
        records = choices.prompt_logprobs(choice.prompt_index)
        return [None] + [vllm_logprobs(r, self.texts) for r in records]

    def _logprobs(
        self, body: CompletionRequest, choice: Choice, choices: Choices, records: list
    ) -> dict[str, Any]:
        """`records` (the output's), after the prompt's when echoing."""
        if not body.echo:
            return completion_logprobs(records, self.texts)
        prompt = choices.prompt_logprobs(choice.prompt_index)
        first = choice.last.first_prompt_token_id
        return completion_logprobs(prompt + records, self.texts, first=first)

    async def _stream(
        self, request_id: str, body: CompletionRequest, choices: Choices, state: _StreamState
    ) -> AsyncIterator[str]:
        envelope = self._envelope(request_id)
        offsets: dict[int, int] = {}
        try:
            first = await choices.next_item()
        except BaseException:
            choices.abort()
            raise
        async for item in stream_items(choices, first):
            if isinstance(item, Failed):
                state.done = True
                self.metrics.requests.inc(outcome=f"http_{status_of(item.error)}")
                yield _sse(error_body(status_of(item.error), public_message(item.error)))
                break
            choice = choices.take(item)
            text, records = item.delta, list(item.logprobs)
            logprobs, extra = None, {}
            if choice.index not in offsets:  # the choice's first chunk: the echo first
                echo = self._echo(body, choice)
                text, offsets[choice.index] = echo + text, len(echo)
                if body.logprobs is not None:
                    logprobs = self._logprobs(body, choice, choices, records)
                if body.prompt_logprobs is not None:  # as in the JSON answer's choice
                    extra = {"prompt_logprobs": self._prompt_logprobs(choices, choice)}
            elif body.logprobs is not None:
                logprobs = completion_logprobs(records, self.texts, offsets[choice.index])
            offsets[choice.index] += sum(len(self.texts(r.token_id)) for r in records)
            if text or records or item.finished or extra:
                part = {"index": choice.index, "text": text, "logprobs": logprobs,
                        "finish_reason": item.finish_reason if item.finished else None,
                        **extra}  # fmt: skip
                yield _sse(envelope | {"choices": [part]})
        else:
            state.done = True
            if body.include_usage:
                yield _sse(envelope | {"usage": _usage(choices.ordered())})
        yield "data: [DONE]\n\n"


class _NotFound(ValueError):
    status = 404


def _best(ordered: list[Choice], params: SamplingParams) -> list[Choice]:
    """Per prompt, the n choices of highest cumulative logprob when best_of > n."""
    if params.best_of is None or params.best_of <= params.n:
        return ordered
    out = []
    for p in sorted({c.prompt_index for c in ordered}):
        mine = [c for c in ordered if c.prompt_index == p]
        out += sorted(mine, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
    return out


def _usage(choices: list[Choice]) -> dict:
    """Every prompt once, every choice's completion tokens."""
    firsts = {c.prompt_index: c.last for c in reversed(choices)}
    return make_usage(
        sum(s.num_prompt_tokens for s in firsts.values()),
        sum(s.num_image_tokens for s in firsts.values()),
        sum(s.num_cached_tokens for s in firsts.values()),
        sum(c.last.num_output_tokens for c in choices),
    )

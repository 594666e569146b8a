"""`POST /v1/chat/completions`: messages → engine Request, then a JSON answer or an SSE
stream of token deltas. Errors before the first byte are OpenAI error responses with
their status; a failure after the stream has begun is sent as an `error` event."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from encoders.errors import TooManyImagesError
from scheduler.config import request_class
from vlmserve.inputs.processing import Request
from vlmserve.server.choices import Choice, Choices, fan_out, stream_items
from vlmserve.server.engine_loop import EngineLoop, Failed, Item, Snapshot
from vlmserve.server.media import MediaPolicy, check_image_header, load_media
from vlmserve.server.metrics import ServerMetrics
from vlmserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ImagePart,
    chunk_body,
    completion_body,
    error_body,
    make_usage,
)
from vlmserve.server.sampling_fields import TokenTexts, chat_logprobs, vllm_logprobs
from vlmserve.server.tools import (
    ToolPlan,
    ToolStream,
    chat_template_of,
    finish_reason_of,
    message_of,
    plan_tools,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatSettings:
    model_name: str
    media: MediaPolicy
    max_images_per_request: int
    default_max_tokens: int


def status_of(error: BaseException) -> int:
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    return 400 if isinstance(error, ValueError) else 500


# An object repr, or a bare pointer (longer than an IPv4 address written in hex).
_ADDRESS = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>|\b0x[0-9a-fA-F]{10,}\b")


def public_message(error: BaseException) -> str:
    """What a client may read of `error`: our own messages (typed errors, validation),
    minus any object address; for anything else (a bug, a library's internals) only that
    it was internal — the details go to the server log."""
    if getattr(error, "status", None) is None and not isinstance(error, ValueError):
        log.error("internal error answered with 500: %r", error)
        return "internal server error (see the server log)"
    return _ADDRESS.sub("<object>", str(error))[:2000]


def error_response(error: BaseException) -> JSONResponse:
    status = status_of(error)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    body = error_body(status, public_message(error))
    return JSONResponse(body, status_code=status, headers=headers)


async def build_messages(
    messages: list[ChatMessage], settings: ChatSettings, metrics: ServerMetrics
) -> list[dict]:
    """Engine messages: image_url parts fetched (concurrently) and header-checked."""
    parts = [p for m in messages if isinstance(m.content, list) for p in m.content]
    urls = [p.image_url.url for p in parts if isinstance(p, ImagePart)]
    if len(urls) > settings.max_images_per_request:
        raise TooManyImagesError(
            f"request has {len(urls)} images, the limit is {settings.max_images_per_request}"
        )
    start = time.perf_counter()
    blobs = await asyncio.gather(*(load_media(url, settings.media) for url in urls))
    if urls:
        metrics.stage.observe(time.perf_counter() - start, stage="fetch")
    for blob in blobs:
        check_image_header(blob, settings.media.max_image_pixels)
    images = iter(blobs)
    converted = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = [
                {"type": "image", "image": next(images)}
                if isinstance(part, ImagePart)
                else {"type": "text", "text": part.text}
                for part in content
            ]
        role = "system" if message.role == "developer" else message.role
        extra = message.model_extra or {}  # a tool-calling turn, for the chat template
        passed = {key: extra[key] for key in ("tool_calls", "tool_call_id") if key in extra}
        converted.append({"role": role, "content": content or "", **passed})
    return converted


class Handler:
    """An endpoint's handler: the engine loop, the settings and metrics it serves with."""

    def __init__(self, loop: EngineLoop, settings: ChatSettings, metrics: ServerMetrics):
        self.loop, self.settings, self.metrics = loop, settings, metrics
        self._texts: TokenTexts | None = None

    @property
    def texts(self) -> TokenTexts:
        """Token texts for logprobs: the app's (`use_texts`, made as the engine loaded),
        else made now (the engine is loaded once a request got this far)."""
        if self._texts is None:
            self._texts = TokenTexts(self.loop.engine.tokenizer)
        return self._texts

    def use_texts(self, texts: TokenTexts) -> None:
        self._texts = texts


class ChatHandler(Handler):
    async def __call__(self, body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        arrival = time.perf_counter()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            if body.model is not None and body.model != self.settings.model_name:
                return self._refuse(
                    404, f"model {body.model!r} does not exist (this server: "
                    f"{self.settings.model_name!r})",
                )  # fmt: skip
            sampling = body.to_sampling(self.settings.default_max_tokens)
            tools = plan_tools(body.model_extra or {}, chat_template_of(self.loop.engine))
            if tools is not None and tools.structured is not None:
                if sampling.structured is not None:
                    raise ValueError("a constraint and tool_choice cannot both be sent")
                sampling = dataclasses.replace(sampling, structured=tools.structured)
            messages = await build_messages(body.messages, self.settings, self.metrics)
            track = _Tracker(arrival, self.metrics, request_class(_num_images(messages)))
            choices = Choices(self.loop, track.on_snapshot)
            base = Request(messages, tools=tools.template_tools if tools is not None else None)
            choices.submit(fan_out(base, sampling, request_id))
        except Exception as e:  # mapped to its 4xx/5xx
            return self._failed(e)
        failed = await choices.accepted()
        if failed is not None:
            return self._failed(failed.error)
        self.metrics.stage.observe(choices.process_s, stage="process")
        if body.stream:
            # An image's decode may still fail after Accepted: wait for the first item so
            # a bad image is a 4xx JSON error, not a 200 stream with an error event.
            try:
                second = await choices.next_item()
            except BaseException:  # cancelled (client gone, server shutting down)
                choices.abort()
                raise
            if isinstance(second, Failed):
                choices.abort()
                return self._failed(second.error)
            state = _StreamState()
            stream = self._stream(request_id, body, choices, state, second, tools)
            return _AbortingStream(stream, lambda: self._close_stream(choices, state))
        return await self._complete(request_id, body, choices, http, tools)

    def _refuse(self, status: int, message: str) -> JSONResponse:
        self.metrics.requests.inc(outcome=f"http_{status}")
        return JSONResponse(error_body(status, message), status_code=status)

    def _failed(self, error: BaseException) -> JSONResponse:
        self.metrics.requests.inc(outcome=f"http_{status_of(error)}")
        return error_response(error)

    async def _complete(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        choices: Choices,
        http: HTTPRequest,
        tools: ToolPlan | None = None,
    ) -> Response:
        failed = await choices.complete(http.is_disconnected)
        if failed is not None:
            return self._failed(failed.error)
        ordered = choices.ordered()
        if any(c.last.finish_reason == "abort" for c in ordered):
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = completion_body(
            request_id, self.settings.model_name, ordered[0].text,
            ordered[0].last.finish_reason, _usage(ordered),
        )  # fmt: skip
        template = out["choices"][0]
        out["choices"] = []
        for c in ordered:
            message, has_calls = message_of(tools, c.text)  # tool calls parsed out
            out["choices"].append(template | {
                "index": c.index, "message": message,
                "finish_reason": finish_reason_of(tools, c.last.finish_reason, has_calls),
                "logprobs": self._logprobs(body, c.logprobs),
            })  # fmt: skip
        if body.prompt_logprobs is not None:  # choice 0 computed them (n > 1: the same)
            prompt = next((c.prompt_logprobs for c in ordered if c.prompt_logprobs), ())
            out["prompt_logprobs"] = self._prompt_logprobs(prompt)
        return JSONResponse(out)

    def _logprobs(self, body: ChatCompletionRequest, records) -> dict | None:
        return chat_logprobs(list(records), self.texts) if body.logprobs else None

    def _prompt_logprobs(self, records) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: one entry per prompt token, None for the first (nothing
        predicts it); image placeholder positions score the placeholder's id, as vLLM."""
        return [None if r is None else vllm_logprobs(r, self.texts) for r in records]

    def _close_stream(self, choices: Choices, state: _StreamState) -> None:
        if not state.done:  # the client went away: free its blocks within one step
            state.done = True
            choices.abort()
            self.metrics.requests.inc(outcome="abort")

    async def _stream(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        choices: Choices,
        state: _StreamState,
        first: Item,
        tools: ToolPlan | None = None,
    ) -> AsyncIterator[str]:
        model, created = self.settings.model_name, int(time.time())
        calls: dict[int, ToolStream] = {}  # per choice, with tools
        # prompt_logprobs ride on the first chunk, at its top level (the first snapshot
        # carries them); should that one lack them, on the first chunk after that does.
        prompt_pending = body.prompt_logprobs is not None
        for c in choices.ordered():
            role = {"role": "assistant", "content": ""}
            chunk = chunk_body(request_id, model, created, role, index=c.index)
            if prompt_pending and isinstance(first, Snapshot) and first.prompt_logprobs:
                chunk["prompt_logprobs"] = self._prompt_logprobs(first.prompt_logprobs)
                prompt_pending = False
            yield _sse(chunk)
        async for item in stream_items(choices, first):
            if isinstance(item, Failed):
                state.done = True  # terminal already: nothing to abort
                self.metrics.requests.inc(outcome=f"http_{status_of(item.error)}")
                yield _sse(error_body(status_of(item.error), public_message(item.error)))
                break
            choice = choices.take(item)
            delta: dict | None = {"content": item.delta}
            if tools is not None:
                delta = calls.setdefault(choice.index, ToolStream(tools)).delta(item.delta)
            prompt = prompt_pending and bool(item.prompt_logprobs)
            # The engine holds back what a stop string could still cut.
            if (item.delta and delta) or (body.logprobs and item.logprobs) or prompt:
                chunk = chunk_body(request_id, model, created, delta or {"content": ""},
                                   index=choice.index)  # fmt: skip
                chunk["choices"][0]["logprobs"] = self._logprobs(body, item.logprobs)
                if prompt:
                    chunk["prompt_logprobs"] = self._prompt_logprobs(item.prompt_logprobs)
                    prompt_pending = False
                yield _sse(chunk)
            if item.finished:
                reason = item.finish_reason
                if tools is not None:
                    stream = calls.setdefault(choice.index, ToolStream(tools))
                    final = stream.final()
                    if final:
                        yield _sse(chunk_body(request_id, model, created, final,
                                              index=choice.index))  # fmt: skip
                    reason = finish_reason_of(tools, reason, stream.has_calls)
                yield _sse(chunk_body(request_id, model, created, {}, reason,
                                      index=choice.index))  # fmt: skip
        else:
            state.done = True
            if body.include_usage:
                usage = _usage(choices.ordered())
                yield _sse(chunk_body(request_id, model, created, None, None, usage))
        yield "data: [DONE]\n\n"


@dataclass
class _StreamState:
    done: bool = False  # the request reached its terminal item


class _AbortingStream(StreamingResponse):
    """An SSE response that calls `on_close` however it ends, even when the client left
    before the body iterator started (its own `finally` would then never run)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _num_images(messages: list[dict]) -> int:
    return sum(
        1
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image"
    )


class _Tracker:
    """Per-request latency metrics: TTFT, time per output token, end to end; TTFT and TPOT
    also by class (text / image: whether the request carries images)."""

    def __init__(self, arrival: float, metrics: ServerMetrics, cls: str) -> None:
        self.arrival, self.metrics, self.cls = arrival, metrics, cls
        self.first: float | None = None

    def on_snapshot(self, item: Snapshot) -> None:
        now = time.perf_counter()
        if self.first is None and item.num_output_tokens > 0:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.class_ttft.observe(now - self.arrival, **{"class": self.cls})
        if not item.finished:
            return
        m = self.metrics
        m.requests.inc(outcome=item.finish_reason or "unknown")
        m.e2e.observe(now - self.arrival)
        if self.first is not None and item.num_output_tokens > 1:
            tpot = (now - self.first) / (item.num_output_tokens - 1)
            m.tpot.observe(tpot)
            m.class_tpot.observe(tpot, **{"class": self.cls})
        m.prompt_tokens.inc(item.num_prompt_tokens)
        m.cached_tokens.inc(item.num_cached_tokens)
        m.generation_tokens.inc(item.num_output_tokens)


def _usage(choices: list[Choice]) -> dict:
    """The prompt once (as OpenAI counts n > 1), the completion tokens of every choice."""
    first = choices[0].last
    return make_usage(
        first.num_prompt_tokens, first.num_image_tokens, first.num_cached_tokens,
        sum(c.last.num_output_tokens for c in choices),
    )  # fmt: skip


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

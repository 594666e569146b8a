"""The FastAPI app: routes, error mapping to OpenAI's error shape, lifespan.

`create_app(engine_factory, config)` builds the app; the engine is built in the engine
thread at startup, so `/health` answers 503 while it loads and while the server drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmserve.engine.core import Engine
from vlmserve.server.chat import ChatHandler, ChatSettings
from vlmserve.server.completions import CompletionHandler, CompletionRequest
from vlmserve.server.engine_loop import EngineLoop
from vlmserve.server.guards import Guard
from vlmserve.server.media import MediaPolicy
from vlmserve.server.metrics import CONTENT_TYPE, ServerMetrics
from vlmserve.server.protocol import DEFAULT_MAX_TOKENS, ChatCompletionRequest, error_body
from vlmserve.server.sampling_fields import TokenTexts
from vlmserve.server.utility_routes import add_utility_routes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_images_per_request: int = 16
    max_pending_requests: int = 256  # bounded admission: over it, 429
    max_body_bytes: int = 64 << 20
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be >= 1")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be >= 1")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset for no key)")


def create_app(
    engine_factory: Callable[[], Engine],
    config: ServerConfig,
    on_engine_death: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """`on_engine_death(cause)` runs on the engine thread when the engine fails to load or
    dies; `vlmserve serve` passes one that stops the server, which then exits non-zero."""

    def load() -> Engine:  # on the engine thread, before /health turns 200
        engine = engine_factory()
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is not None:  # logprobs' token texts: the shared Rust path, or a copy
            start = time.perf_counter()
            backend = getattr(getattr(engine, "processor", None), "thread_safe_backend", None)
            texts = TokenTexts(tokenizer, backend)
            chat.use_texts(texts)
            completions.use_texts(texts)
            log.info("token texts (logprobs) ready in %.1f s", time.perf_counter() - start)
        return engine

    loop = EngineLoop(load, config.max_pending_requests, on_engine_death)
    metrics = ServerMetrics(loop.stats)
    settings = ChatSettings(
        config.model_name, config.media, config.max_images_per_request, config.default_max_tokens
    )
    chat = ChatHandler(loop, settings, metrics)
    completions = CompletionHandler(loop, settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with anyio.create_task_group():  # its backend imported now, not by a stream
            pass
        loop.start()
        yield
        loop.begin_drain()
        deadline = time.monotonic() + config.drain_timeout_s
        while loop.num_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(loop.stop)

    app = FastAPI(title="vlmserve", lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.metrics = metrics
    app.state.config = config
    count = lambda status: metrics.requests.inc(outcome=f"http_{status}")
    app.add_middleware(
        Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes, on_refuse=count
    )
    _add_error_handlers(app, count)

    @app.get("/health")
    async def health() -> JSONResponse:
        if loop.state == "ready":
            return JSONResponse({"status": "ok"})
        detail = {"status": loop.state}
        if loop.load_error is not None:  # the details are in the server log
            detail["error"] = f"the engine failed ({type(loop.load_error).__name__})"
        return JSONResponse(detail, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "vlmserve"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await chat(body, http)

    @app.post("/v1/completions")
    async def text_completions(body: CompletionRequest, http: HTTPRequest):
        return await completions(body, http)

    add_utility_routes(app, chat)

    return app


def _add_error_handlers(app: FastAPI, count: Callable[[int], None]) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            count(400)
            message = "malformed JSON body: " + "; ".join(str(e.get("msg")) for e in errors)
            return JSONResponse(error_body(400, message), status_code=400)
        count(422)
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:5]
        )
        return JSONResponse(error_body(422, message, param), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal(request: HTTPRequest, exc: Exception) -> JSONResponse:
        count(500)
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        message = "internal server error (see the server log)"
        return JSONResponse(error_body(500, message), status_code=500)

"""`POST /tokenize`, `POST /detokenize`, `GET /version` (vLLM's names and shapes).

/tokenize runs the engine's own prompt processing (on a worker thread, with that
thread's tokenizer copy), so its ids are the ones /v1/completions and
/v1/chat/completions would run: a `prompt` as raw text (special tokens added as the
checkpoint's tokenizer adds them), or `messages` through the chat template with image
placeholders expanded to the image's token count.
"""

from __future__ import annotations

import asyncio
from importlib import metadata

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from vlmserve.inputs.processing import Request
from vlmserve.server.chat import ChatHandler, build_messages, error_response
from vlmserve.server.protocol import ChatMessage

MAX_DETOKENIZE = 1 << 20


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


def version() -> str:
    try:
        return metadata.version("vlmserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_utility_routes(app: FastAPI, chat: ChatHandler) -> None:
    loop = chat.loop

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        try:
            if (body.prompt is None) == (body.messages is None):
                raise ValueError("send exactly one of prompt and messages")
            if body.messages is not None:
                messages = await build_messages(body.messages, chat.settings, chat.metrics)
                request = Request(messages)
            else:
                request = Request(prompt=body.prompt)
            engine = loop.engine
            if engine is None or loop.state != "ready":
                raise _Unavailable(f"the engine is {loop.state}")
            prompt = await asyncio.to_thread(engine.processor.process, request)
        except Exception as e:  # mapped to its 4xx/5xx
            return error_response(e)
        ids = list(prompt.token_ids)
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        engine = loop.engine
        if engine is None or loop.state != "ready":
            return error_response(_Unavailable(f"the engine is {loop.state}"))
        vocab = engine.runner.model.decoder.cfg.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            message = f"tokens must be ids in [0, {vocab}), got {bad[:3]}"
            return error_response(ValueError(message))
        return JSONResponse({"prompt": chat.texts.decode(body.tokens)})

    @app.get("/version")
    async def get_version() -> JSONResponse:
        return JSONResponse({"version": version()})


class _Unavailable(RuntimeError):
    status = 503

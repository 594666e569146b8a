"""The front door of `vlmserve serve --replicas N`: one HTTP server, N engine replicas.

Every OpenAI route (`/v1/...`, `/tokenize`, `/detokenize`, `/version`) is handed whole to
a replica through the deployment handle, with the request's routing keys
(`scheduler.routing.route_keys.keys_from_body`) for the request router to read, and the
replica's answer (status, headers, body or SSE stream) is passed back as it comes: the
replica runs the same app as one `vlmserve serve`, so the answers are the same. An
uploaded image weighs its visual tokens, read from its header as the engine counts them.
A replica that dies with requests in flight ends each of them with a clear error: a 503
before the first byte, an `error` event (then `[DONE]`) inside a stream; nothing is
retried, so no request is answered twice. `/health` is 200 while at least one replica
is RUNNING; `/metrics` is every live replica's metrics, each series labelled
`replica="<id>"`, plus `vlmserve_replicas_running`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from scheduler.routing.policy import RouteKeys
from scheduler.routing.route_keys import keys_from_body
from vlmserve.server.guards import Guard
from vlmserve.server.metrics import CONTENT_TYPE
from vlmserve.server.protocol import error_body

__all__ = ["create_front_app", "label_replica"]

log = logging.getLogger(__name__)
FORWARDED = ("/v1/{path:path}", "/tokenize", "/detokenize", "/version")
_HOP = {"content-length", "transfer-encoding", "connection"}
_REPLICA_LOST = "the replica serving this request failed ({}); it is being restarted: retry"


def create_front_app(
    handle: Any,
    num_running: Callable[[], int],
    live_replica_ids: Callable[[], list[str]],
    api_key: str | None = None,
    max_body_bytes: int = 64 << 20,
    image_tokens: Callable[[bytes], int | None] | None = None,
) -> FastAPI:
    """`handle`: the engine deployment's; `num_running()`: replicas Ray Serve counts
    RUNNING; `live_replica_ids()`: the ids the request router knows (for /metrics);
    `image_tokens`: an upload's visual tokens from its bytes (`launch.routing_profile`),
    its routing weight; None where unknown."""
    app = FastAPI(title="vlmserve (replicas)")
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> JSONResponse:
        running = await asyncio.to_thread(num_running)
        if running >= 1:
            return JSONResponse({"status": "ok", "replicas_running": running})
        return JSONResponse({"status": "no replica running", "replicas_running": 0}, 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        ids = live_replica_ids()
        calls = [handle.metrics.remote(target=rid) for rid in ids]
        texts = await asyncio.gather(*(_within(c, 10.0) for c in calls), return_exceptions=True)
        parts = [
            label_replica(t, rid) for rid, t in zip(ids, texts, strict=True) if isinstance(t, str)
        ]
        running = await asyncio.to_thread(num_running)
        head = "# HELP vlmserve_replicas_running Engine replicas Ray Serve counts RUNNING.\n"
        head += f"# TYPE vlmserve_replicas_running gauge\nvlmserve_replicas_running {running}\n"
        return PlainTextResponse(head + _merge(parts), media_type=CONTENT_TYPE)

    async def forward(request: HTTPRequest) -> Response:
        body = await request.body()
        post = request.method == "POST"
        keys = await _keys(body, request, image_tokens) if post else RouteKeys()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() != "host"]
        call = handle.options(stream=True).handle_http.remote(
            request.method, request.url.path, request.url.query.encode(), headers, body,
            route=keys,
        )  # fmt: skip
        try:
            head = await call.__anext__()
            status = head["status"]
            out_headers = {k: v for k, v in head["headers"] if k.lower() not in _HOP}
            if out_headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(_stream(call), status, out_headers)
            content = b"".join([chunk async for chunk in call])
        except asyncio.CancelledError:  # the client left: the replica stops too
            call.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - a dead replica, or no replica at all
            return _lost(e)
        return Response(content, status, out_headers)

    for route in FORWARDED:
        app.add_api_route(route, forward, methods=["GET", "POST"], include_in_schema=False)
    return app


async def _keys(
    body: bytes, request: HTTPRequest, image_tokens: Callable[[bytes], int | None] | None
) -> RouteKeys:
    def priced(data: bytes) -> int | None:
        try:
            return image_tokens(data) if image_tokens is not None else None
        except Exception as e:  # noqa: BLE001 - a bad image routes unpriced, never fails here
            log.debug("no routing cost for an image: %r", e)
            return None

    def parse() -> RouteKeys:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return RouteKeys()  # the replica answers the malformed body
        if not isinstance(doc, dict):
            return RouteKeys()
        return keys_from_body(doc, dict(request.headers), priced)

    # Hashing (and reading the headers of) a large upload's images is worth a thread.
    return await asyncio.to_thread(parse) if len(body) > 65536 else parse()


async def _stream(call: Any) -> AsyncIterator[bytes]:
    done = False
    try:
        async for chunk in call:
            yield chunk
        done = True
    except Exception as e:  # noqa: BLE001 - the replica died mid-stream
        done = True
        log.warning("a replica failed mid-stream: %r", e)
        error = error_body(503, _REPLICA_LOST.format(type(e).__name__))
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        if not done:  # the client left mid-stream: the replica's engine aborts it
            call.cancel()


def _lost(e: BaseException) -> JSONResponse:
    log.warning("a replica failed before answering: %r", e)
    return JSONResponse(error_body(503, _REPLICA_LOST.format(type(e).__name__)), 503)


async def _within(response: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(_awaited(response), timeout_s)


async def _awaited(response: Any) -> Any:
    return await response


def label_replica(text: str, replica: str) -> str:
    """Prometheus text with `replica="<id>"` added to every sample's labels."""
    label = f'replica="{replica}"'
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            closing = "," if line[brace + 1] != "}" else ""
            out.append(f"{line[: brace + 1]}{label}{closing}{line[brace + 1 :]}")
        else:
            out.append(f"{line[:space]}{{{label}}}{line[space:]}")
    return "\n".join(out) + "\n"


def _merge(parts: list[str]) -> str:
    """Each metric's HELP/TYPE once, its samples from every replica under it."""
    order: list[str] = []
    comments: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for text in parts:
        current = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split()[2]
                if current not in comments:
                    order.append(current)
                    comments[current], samples[current] = [], []
                if line not in comments[current]:
                    comments[current].append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(current, []).append(line)
                if current not in comments:
                    order.append(current)
                    comments[current] = []
    return "".join("\n".join(comments[m] + samples[m]) + "\n" for m in order)

"""One HTTP request through an ASGI app in this process, its response as it comes.

A replica runs the very app `vlmserve serve` runs (`vlmserve.server.app.create_app`) and
the front door hands it each request as plain data (method, path, headers, body), so
every route, error and stream is answered by the same code as with one engine. The
response comes back as a head (`{"status", "headers"}`) and then the body's chunks, each
as the app sent it (an SSE stream stays a stream). When the caller stops reading (its
client left), the app is told the client disconnected, so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = ["call_asgi"]


async def call_asgi(
    app: Callable,
    method: str,
    path: str,
    query: bytes,
    headers: list[tuple[str, str]],
    body: bytes,
) -> AsyncIterator[dict[str, Any] | bytes]:
    """Yield the response head, then its body chunks."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    finished = False
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or raised) without ending its body
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
                finished = True
                return
            if message["type"] == "http.response.start":
                raw = message.get("headers", [])
                yield {
                    "status": message["status"],
                    "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw],
                }
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    finished = True
                    return
    finally:
        if not finished:  # the caller left early: the app sees its client go
            disconnected.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - its error was raised above
            task.cancel()

"""ASGI guard in front of the routes: the API key on `/v1` and the request body cap.

Both run before FastAPI parses anything, so an unauthenticated or oversized request
costs no JSON parsing and gets its 401/413 whatever its body holds.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from vlmserve.server.protocol import error_body


class Guard:
    def __init__(
        self,
        app,
        api_key: str | None,
        max_body_bytes: int,
        on_refuse: Callable[[int], None] = lambda status: None,
    ) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            token = headers.get("authorization", "")
            scheme, _, value = token.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                value.strip().encode(), self.api_key.encode()
            ):
                await self._refuse(send, 401, "missing or invalid API key (Authorization: Bearer)")
                return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(send, 413, f"request body is over {self.max_body_bytes} bytes")
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive)
            if body is None:
                await self._refuse(send, 413, f"request body is over {self.max_body_bytes} bytes")
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _refuse(self, send, status: int, message: str) -> None:
        self.on_refuse(status)
        await _send_error(send, status, message)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None past the cap (a chunked body has no Content-Length)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # disconnected: the route sees an empty body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that hands the buffered body over once, then the real messages
    (so disconnects still reach the route)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


async def _send_error(send, status: int, message: str) -> None:
    payload = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

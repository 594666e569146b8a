"""Shared pieces of the reliability suite: images and request bodies, and one HTTP
request -> one `Outcome`, the terminal answer every request must get, counted and tabled.
The server under test and its vital signs are in benchmarks/reliability/server.py.

What the suite counts as a failure: a 5xx that was not the target of the fault, a
transport error or timeout (a lost request), a 4xx without a message, a server process
that exited, KV blocks or /dev/shm blocks not back to where they started.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import random
import subprocess
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import httpx
import numpy as np
from PIL import Image

from benchmarks.lib.common import RESULTS, table
from benchmarks.serving.serve_load import WORDS

ROOT = Path(__file__).resolve().parents[2]
RESULT_PATH = RESULTS / "reliability.json"

Verdict = Literal["ok", "4xx", "5xx", "client_abort", "lost"]
# What a section expects of a request: ok; 4xx (with a message); abort (cut by the
# client, or done before the cut); retryable (ok, or a 503 with a message); any (a
# targeted request: any terminal answer with a message).
Expect = Literal["ok", "4xx", "abort", "retryable", "any"]


# -- images and bodies -------------------------------------------------------------------


def png_bytes(seed: int, width: int = 64, height: int = 48, fmt: str = "PNG") -> bytes:
    """A noisy, never-blank RGB image (Idefics3 drops all-zero tiles)."""
    pixels = np.random.default_rng(seed).integers(1, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def user_message(text: str, urls: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def prompt_text(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(3, 8)))


def chat_body(messages: list[dict], max_tokens: int, stream: bool = False) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# -- one request, one terminal answer ----------------------------------------------------


@dataclass
class Outcome:
    """How one request ended, seen from the client."""

    label: str  # the request's kind in its section
    verdict: Verdict
    status: int | None = None  # HTTP status (200 also for a stream that sent an error event)
    message: str | None = None  # the error message, when there was one
    num_tokens: int = 0
    seconds: float = 0.0
    expect: Expect = "ok"

    @property
    def is_expected(self) -> bool:
        if self.expect == "any":  # a targeted request: any terminal answer with a message
            return self.verdict != "lost" and (self.verdict == "ok" or bool(self.message))
        if self.verdict in ("5xx", "lost"):
            return False
        if self.expect == "retryable":  # a worker died under it: retried, or a 503
            return self.verdict == "ok" or (self.status == 503 and bool(self.message))
        if self.expect == "4xx":
            return self.verdict == "4xx" and bool(self.message)
        if self.expect == "abort":
            return self.verdict in ("client_abort", "ok")  # it may finish before the cut
        return self.verdict == "ok"


def _error_message(raw: bytes) -> str | None:
    try:
        return json.loads(raw)["error"]["message"] or None
    except (ValueError, KeyError, TypeError):
        return None


def _verdict_for(status: int) -> Verdict:
    if 200 <= status < 300:
        return "ok"
    return "4xx" if 400 <= status < 500 else "5xx"


async def send(
    client: httpx.AsyncClient,
    body: dict,
    label: str,
    expect: Expect = "ok",
    abort_after_chunks: int | None = None,
    abort_after_s: float | None = None,
) -> Outcome:
    """POST one chat completion and classify its terminal answer. `abort_after_chunks`
    (streams) closes the connection after that many SSE data lines; `abort_after_s`
    (non-streamed) gives up after that long: both are client disconnects."""
    start = time.perf_counter()
    done = lambda **kw: Outcome(label, seconds=time.perf_counter() - start, expect=expect, **kw)
    try:
        if abort_after_s is not None:
            return await _post_then_leave(client, body, abort_after_s, done)
        if not body.get("stream"):
            response = await client.post("/v1/chat/completions", json=body)
            verdict = _verdict_for(response.status_code)
            if verdict == "ok":
                usage = response.json().get("usage") or {}
                return done(verdict="ok", status=200, num_tokens=usage.get("completion_tokens", 0))
            msg = _error_message(response.content)
            return done(verdict=verdict, status=response.status_code, message=msg)
        return await _stream(client, body, abort_after_chunks, done)
    except httpx.TimeoutException as e:
        return done(verdict="lost", message=f"timeout: {e!r}")
    except httpx.HTTPError as e:
        return done(verdict="lost", message=f"transport: {e!r}")


async def _post_then_leave(client, body, after_s, done) -> Outcome:
    task = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    finished, _ = await asyncio.wait({task}, timeout=after_s)
    if not finished:
        task.cancel()  # closes the connection: the server sees the client go
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task
        return done(verdict="client_abort")
    response = task.result()
    verdict = _verdict_for(response.status_code)
    return done(verdict=verdict, status=response.status_code,
                message=None if verdict == "ok" else _error_message(response.content))  # fmt: skip


async def _stream(client, body, abort_after_chunks, done) -> Outcome:
    num_chunks = num_tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raw = await response.aread()
            return done(verdict=_verdict_for(response.status_code),
                        status=response.status_code, message=_error_message(raw))  # fmt: skip
        saw_done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                saw_done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:  # failed after the stream began: status in the event
                status = int(chunk["error"].get("code") or 500)
                return done(verdict=_verdict_for(status), status=status,
                            message=chunk["error"].get("message"))  # fmt: skip
            num_chunks += 1
            if chunk.get("usage"):
                num_tokens = chunk["usage"].get("completion_tokens", 0)
            if abort_after_chunks is not None and num_chunks >= abort_after_chunks:
                return done(verdict="client_abort", status=200)  # leaving closes it
    if not saw_done:
        return done(verdict="lost", status=200, message="stream ended without [DONE]")
    return done(verdict="ok", status=200, num_tokens=num_tokens)


def count(outcomes: list[Outcome]) -> dict:
    """The counts every section reports."""
    verdicts = Counter(o.verdict for o in outcomes)
    unexpected = [o for o in outcomes if not o.is_expected]
    return {
        "requests": len(outcomes),
        "ok": verdicts["ok"],
        "4xx": verdicts["4xx"],
        "5xx": verdicts["5xx"],
        "client_abort": verdicts["client_abort"],
        "lost": verdicts["lost"],
        "4xx_without_message": sum(1 for o in outcomes if o.verdict == "4xx" and not o.message),
        "unexpected": len(unexpected),
        "statuses": dict(sorted(Counter(str(o.status) for o in outcomes).items())),
        "unexpected_examples": [asdict(o) for o in unexpected[:8]],
    }


def by_label(outcomes: list[Outcome]) -> list[dict]:
    rows = []
    for label in sorted({o.label for o in outcomes}):
        c = count([o for o in outcomes if o.label == label])
        keys = ("requests", "ok", "4xx", "5xx", "client_abort", "lost", "unexpected")
        rows.append({"kind": label, **{k: c[k] for k in keys}})
    return rows


def print_table(title: str, outcomes: list[Outcome]) -> None:
    rows = by_label(outcomes)
    total = count(outcomes)
    rows.append({"kind": "ALL", **{k: total[k] for k in rows[0] if k != "kind"}} if rows else {})
    columns = ["kind", "requests", "ok", "4xx", "5xx", "client_abort", "lost", "unexpected"]
    print(f"\n== {title}")
    print(table(rows, columns))


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def client(url: str, timeout: float = 120.0, max_connections: int = 64) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=16)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False)


async def gather_limited(coros: list, concurrency: int) -> list:
    """Run the coroutines with at most `concurrency` in flight, results in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(coro):
        async with gate:
            return await coro

    return await asyncio.gather(*(one(c) for c in coros))


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"

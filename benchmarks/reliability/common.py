"""Shared pieces of the reliability suite: a real `vlmserve serve` subprocess on loopback
(or an in-process uvicorn for fault injection), its vital signs (KV gauges from
/metrics, RSS from /proc, its /dev/shm blocks, its preprocessing workers), and one
HTTP request -> one `Outcome`, the terminal answer every request must get.

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
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import numpy as np
from PIL import Image

from benchmarks.common import RESULTS, table
from benchmarks.serve_load import WORDS

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


# -- the server under test ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled Prometheus samples (and `name{labels}` keys verbatim)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def shm_blocks(server_pid: int) -> list[str]:
    """The server's preprocessing blocks: workers name them vlm{server pid:x}_..."""
    prefix = f"vlm{server_pid:x}_"
    return (
        sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
        if os.path.isdir("/dev/shm")
        else []
    )


@dataclass
class Vitals:
    free_blocks: float
    num_blocks: float
    pending: float
    running: float
    waiting: float
    rss_kib: int
    shm_blocks: list[str] = field(default_factory=list)


# `vlmserve serve` exactly as the CLI runs it (`vlmserve.cli.main.main(["serve", ...])`), plus
# one read-only route, GET /debug/integrity, that runs the KV allocator's
# `check_integrity()` (called only when the server is idle: the engine thread owns it).
# Inline (-c) so the server can run any source tree, one without this package included.
_SERVE_WITH_PROBE = """
import sys
import vlmserve.server.app as app_module
import vlmserve.cli.main as cli
_create_app = app_module.create_app

def create_app(*args, **kwargs):
    app = _create_app(*args, **kwargs)

    @app.get("/debug/integrity")
    def integrity():
        bm = app.state.engine_loop.engine.scheduler.block_manager
        try:
            bm.check_integrity()
            error = None
        except AssertionError as e:
            error = str(e) or "check_integrity failed"
        return {"ok": error is None, "error": error, "free_blocks": bm.num_free_blocks,
                "num_blocks": bm.num_blocks}

    @app.get("/debug/kv")
    def kv():
        bm = app.state.engine_loop.engine.scheduler.block_manager
        return {"free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks}

    return app

app_module.create_app = create_app
sys.exit(cli.main(["serve", *sys.argv[1:]]))
"""


class ServerProcess:
    """`vlmserve serve` in a subprocess on 127.0.0.1 (with /debug/integrity added); `with`
    waits for /health."""

    def __init__(self, *extra_args: str, root: Path = ROOT, log_path: Path | None = None) -> None:
        self.root = root  # the source tree the server runs (a snapshot, say)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.serve_args = ["--port", str(self.port), "--served-model-name", "rel", *extra_args]
        self.args = [sys.executable, "-c", _SERVE_WITH_PROBE, *self.serve_args]
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="vlmserve-rel-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> str:
        return "vlmserve serve " + " ".join(self.serve_args)

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(self.root)}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.args, cwd=self.root, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not become ready: {self.log_tail()}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        return self.proc.returncode

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def vitals(self) -> Vitals:
        m = self.metrics()
        kv = httpx.get(self.url + "/debug/kv", timeout=10).json()  # metric names vary
        return Vitals(
            free_blocks=float(kv["free_blocks"]),
            num_blocks=float(kv["num_blocks"]),
            pending=m.get("vlmserve_num_requests_pending", 0.0),
            running=m.get("vlmserve_num_requests_running", 0.0),
            waiting=m.get("vlmserve_num_requests_waiting", 0.0),
            rss_kib=rss_kib(self.pid),
            shm_blocks=shm_blocks(self.pid),
        )

    def integrity(self) -> dict:
        """`check_integrity()` of the KV allocator (call when idle: it walks the tables)."""
        return httpx.get(self.url + "/debug/integrity", timeout=10).json()

    def settled_vitals(self, timeout: float = 30.0) -> Vitals:
        """Vitals once nothing is pending (the engine publishes after each step)."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.vitals()
            idle = v.pending == 0 and v.running == 0 and v.waiting == 0 and v.num_blocks > 0
            if (idle and v.free_blocks == v.num_blocks) or time.monotonic() > deadline:
                return v
            time.sleep(0.1)

    def worker_pids(self) -> list[int]:
        """Preprocessing workers: children of the server's forkserver child."""
        pids = []
        for child in children_of(self.pid):
            with contextlib.suppress(OSError):
                if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                    pids += children_of(child)
        return sorted(pids)


@contextlib.contextmanager
def in_process_server(app, wait_ready: bool = True) -> Iterator[str]:
    """An app (from `create_app`) on uvicorn in a thread on a free loopback port; yields
    its base URL, once /health answers 200 unless `wait_ready` is False."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    while wait_ready and httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not load"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


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

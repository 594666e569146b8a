"""The reliability suite's server under test: a real `vlmserve serve` subprocess on
loopback (+ read-only KV/integrity probes) or an in-process uvicorn for fault injection,
and its vital signs (KV gauges from /metrics, RSS from /proc, its /dev/shm blocks, its
preprocessing workers)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.reliability.common import ROOT


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

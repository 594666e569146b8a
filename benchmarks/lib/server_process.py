"""A benchmark's server process: started in a session of its own (so stopping it stops
its engine children too), ready once GET /health answers 200, stopped on exit."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(  # noqa: PLR0913
    cmd: list[str], env: dict, cwd: Path, log: Path, url: str, name: str,
    timeout_s: float, poll_s: float = 1.0, health: str = "/health",
) -> Iterator[int]:  # fmt: skip
    """Run `cmd` (output to `log`) until GET `url` + `health` answers 200; yields its pid.
    RuntimeError naming `name` and the log when it exits or stays unhealthy for
    `timeout_s`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while not healthy(url, health):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start; log: {log}")
            time.sleep(poll_s)
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def healthy(url: str, health: str = "/health") -> bool:
    try:
        return httpx.get(url + health, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

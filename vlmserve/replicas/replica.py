"""One engine replica: the body of the Ray Serve deployment `vlmserve serve --replicas N`
runs N of.

It holds the app one `vlmserve serve` runs (engine thread, routes, metrics) and answers
the front door's calls: `handle_http` (one HTTP request, streamed back through
`asgi_call`), `metrics` (its Prometheus text), `routing_profile` (its image pricing
and encoder-cache size, `image_cost`), `record_routing_stats` (its KV use, for
the request router) and `check_health` (Ray Serve's probe: an engine that died fails
it, and Ray Serve replaces the replica). The constructor returns
once the engine is loaded and warmed, so Ray Serve counts the replica RUNNING only then.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from vlmserve.config import EngineConfig
from vlmserve.replicas.asgi_call import call_asgi
from vlmserve.replicas.image_cost import RoutingProfile, engine_profile

__all__ = ["EngineReplica"]

log = logging.getLogger(__name__)


class EngineReplica:
    """A Ray Serve deployment class (wrapped by `serve.deployment` in `launch.py`)."""

    def __init__(self, engine_config: EngineConfig, server_config: Any) -> None:
        from vlmserve.engine.core import Engine
        from vlmserve.server.app import create_app

        self.deaths: list[BaseException] = []
        self.app = create_app(lambda: Engine(engine_config), server_config, self.deaths.append)
        self.loop = self.app.state.engine_loop
        self.loop.start()
        while self.loop.state not in ("ready", "failed", "stopped"):
            time.sleep(0.05)
            if self.deaths:
                break
        if self.loop.state != "ready":
            cause = self.deaths[0] if self.deaths else self.loop.load_error
            raise RuntimeError(f"the engine failed to start in replica {os.getpid()}: {cause!r}")

    async def handle_http(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[str, str]],
        body: bytes,
        route: Any = None,  # the router's keys (read by the request router, not here)
    ) -> AsyncIterator[dict[str, Any] | bytes]:
        async for part in call_asgi(self.app, method, path, query, headers, body):
            yield part

    async def metrics(self, target: str | None = None) -> str:
        """This replica's /metrics text (`target` is the router's: which replica)."""
        return self.app.state.metrics.render()

    def routing_profile(self) -> RoutingProfile:
        """What the request router prices images and sizes encoder caches by."""
        return engine_profile(self.loop.engine)

    def record_routing_stats(self) -> dict[str, float]:
        """Ray Serve polls this every `request_routing_stats_period_s` and hands it to the
        request router with the replica: the share of the KV pool in use (a load term)."""
        return {"kv_usage": float(self.loop.stats().get("kv_usage", 0.0))}

    def check_health(self) -> None:
        if self.deaths or self.loop.state != "ready":
            cause = self.deaths[0] if self.deaths else self.loop.state
            raise RuntimeError(f"engine not serving: {cause!r}")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            try:
                loop.stop()
            except Exception:  # noqa: BLE001 - the process is going away
                pass

"""The reliability suite in small (benchmarks/reliability/, full sizes there): a soak of
mixed requests with disconnects and bad images, SSRF probes, one request's encode
raising beside others, and a preprocessing worker killed. Real HTTP on loopback against
in-process servers, so the KV allocator's `check_integrity()` is called directly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")  # the server's libraries: skip, not error, where missing
pytest.importorskip("uvicorn")

from fastapi import FastAPI

from benchmarks.reliability.chaos import _faulty_engine_factory
from benchmarks.reliability.common import (
    Outcome,
    chat_body,
    client,
    count,
    data_url,
    gather_limited,
    png_bytes,
    send,
    user_message,
)
from benchmarks.reliability.server import in_process_server
from benchmarks.reliability.soak import SoakConfig, drive, fallback_bad_images
from benchmarks.reliability.ssrf_http import (
    Canary,
    Redirector,
    connect_attempted,
    direct_probes,
    redirect_probes,
)
from vlmserve.server.app import ServerConfig, create_app
from vlmserve.server.media import MediaError, MediaPolicy, load_media


@dataclass
class Live:
    url: str
    app: FastAPI

    @property
    def engine(self):
        return self.app.state.engine_loop.engine

    def settle(self, timeout: float = 15.0) -> None:
        """Wait until nothing is pending and every KV block is back in the pool."""
        bm, loop = self.engine.scheduler.block_manager, self.app.state.engine_loop
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if loop.num_pending == 0 and bm.num_free_blocks == bm.num_blocks:
                return
            time.sleep(0.02)


@contextlib.contextmanager
def live(factory) -> Iterator[Live]:
    app = create_app(factory, ServerConfig(model_name="rel"))
    with in_process_server(app) as url:
        yield Live(url, app)


@pytest.fixture(scope="module")
def embedded() -> Iterator[tuple[Live, bytes]]:
    """The embedded model, default media rules; its encoder raises on one marker image."""
    factory, marker = _faulty_engine_factory({})
    with live(factory) as server:
        yield server, marker


def run(coro):
    return asyncio.run(coro)


@pytest.mark.slow
def test_soak_small_every_request_answered_and_blocks_back(embedded):
    server, _ = embedded
    bm = server.engine.scheduler.block_manager
    cfg = SoakConfig(num_requests=30, concurrency=8, bad_images=fallback_bad_images(), seed=3)
    outcomes = run(drive(server.url, cfg, cfg.num_requests, cfg.seed))
    c = count(outcomes)
    kinds = {o.label.split("/")[0] for o in outcomes}
    assert {"bad_image", "disconnect", "images", "text"} <= kinds, kinds
    assert (c["lost"], c["5xx"], c["unexpected"]) == (0, 0, 0), c["unexpected_examples"]
    assert c["4xx"] >= 1 and c["4xx_without_message"] == 0
    server.settle()
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.slow
def test_ssrf_probes_all_refused_and_none_connects(embedded):
    server, _ = embedded
    canary = Canary()
    try:
        # Default rules: http:// is refused by scheme alone, so the https spellings.
        probes = [(k, u) for k, u in direct_probes(canary.port) if not k.endswith("/http")]

        async def probe_all() -> list[Outcome]:
            async with client(server.url) as http:
                return await gather_limited(
                    [send(http, chat_body(user_message("x", [u]), 2), u, "4xx") for _, u in probes],
                    8,
                )

        outcomes = run(probe_all())
    finally:
        canary.close()
    not_refused = [(o.label, o.status) for o in outcomes if not o.is_expected]
    assert not_refused == []
    assert canary.hits == 0
    # Refused before any connection: an address the rules miss is dialled even when
    # nothing answers there. IPv4-translated (::ffff:0:a.b.c.d) has its own test.
    dialled = [o.label for o in outcomes if connect_attempted(o) and "::ffff:0:" not in o.label]
    assert dialled == []


@pytest.mark.parametrize("host", ["[::ffff:0:127.0.0.1]", "[::ffff:0:a9fe:a9fe]"])
def test_ipv4_translated_address_refused_before_dialling(host):
    """::ffff:0:a.b.c.d (IPv4-translated, RFC 2765) carries an IPv4 address just as
    IPv4-mapped ::ffff:a.b.c.d does: judged by it, refused before any connection."""
    with pytest.raises(MediaError, match="non-public"):
        run(load_media(f"https://{host}:9/x.png", MediaPolicy(timeout_s=5)))


def test_redirect_chain_to_loopback_refused_at_the_hop():
    canary, redirector = Canary(), Redirector()
    policy = MediaPolicy(allow_http=True, allowed_networks=("127.0.0.2/32",), timeout_s=5)
    try:
        assert run(load_media(redirector.url(), policy))  # the allowed host itself: fetched
        for _, url in redirect_probes(redirector, canary.port):
            with pytest.raises(MediaError):
                run(load_media(url, policy))
    finally:
        canary.close()
        redirector.close()
    assert canary.hits == 0


def test_encode_raising_for_one_request_fails_only_that_request(embedded):
    server, marker = embedded
    bodies = [("marked", chat_body(user_message("marked one", [data_url(marker)]), 6), "any")]
    bodies += [
        ("bystander", chat_body(user_message(f"w{i} what", [data_url(png_bytes(60 + i))]), 6,
                                stream=i % 2 == 0), "ok")
        for i in range(7)
    ]  # fmt: skip
    bodies.insert(3, bodies.pop(0))  # the marked one amid the others

    async def load() -> list[Outcome]:
        async with client(server.url) as http:
            return await gather_limited([send(http, b, lab, e) for lab, b, e in bodies], 8)

    raised_before = server.engine.num_raised
    outcomes = run(load())
    assert server.engine.num_raised > raised_before  # the fault did fire
    marked = [o for o in outcomes if o.label == "marked"]
    assert marked[0].verdict != "ok" and marked[0].message
    bystanders = [(o.verdict, o.status, o.message) for o in outcomes if o.label == "bystander"]
    assert all(v == "ok" for v, _, _ in bystanders), bystanders
    server.settle()
    server.engine.scheduler.block_manager.check_integrity()


def _workers(config) -> dict[int, str]:
    """pid -> shared-memory block prefix of the live workers of the pool this engine config
    uses (pools are shared per process and keyed by their settings: earlier tests' pools
    and their blocks must not be counted)."""
    from encoders.stage import configured_pool

    pool = configured_pool(config.encoder)
    return {w.process.pid: w.prefix for w in pool.workers if w.process.is_alive()}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds workers through /proc")
def test_killed_worker_is_never_blamed_on_the_image(idefics3_path):
    from scheduler.config import CacheConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine

    config = EngineConfig(ModelConfig(str(idefics3_path)), CacheConfig(num_blocks=256))
    body = lambda seed: chat_body(user_message("what", [data_url(png_bytes(seed, 300, 200))]), 2)
    with live(lambda: Engine(config)) as server:

        async def send_all(seeds: list[int]) -> list[Outcome]:
            async with client(server.url) as http:
                return await gather_limited(
                    [send(http, body(s), "img", "retryable") for s in seeds], 4
                )

        assert all(o.verdict == "ok" for o in run(send_all([1, 2, 3, 4])))  # pool started
        before_workers = _workers(config)
        before = sorted(before_workers)
        assert before, "no preprocessing workers found"
        os.kill(before[0], signal.SIGKILL)  # an idle worker: the next image must not pay
        time.sleep(0.2)
        outcomes = run(send_all(list(range(10, 18))))
        bad = [(o.status, o.message) for o in outcomes if not o.is_expected]
        assert bad == [], "a worker's death was blamed on the image (or lost)"
        assert sum(o.status == 503 for o in outcomes) <= 1
        after_workers = _workers(config)
        after = sorted(after_workers)
        assert len(after) == len(before) and before[0] not in after
        blocks = os.listdir("/dev/shm")
        dead = before_workers[before[0]]
        assert not [n for n in blocks if n.startswith(dead)]  # the dead worker's are unlinked
        for prefix in after_workers.values():  # one reused block per live worker at most
            assert len([n for n in blocks if n.startswith(prefix)]) <= 1
        server.settle()
        server.engine.scheduler.block_manager.check_integrity()


@pytest.mark.slow
def test_fuzzed_sampling_fields_are_4xx_never_5xx(llava_ov_path):
    """A small `fields` section: bad values are 4xx with a message, good ones answered,
    none a 5xx; the KV pool comes back whole."""
    from benchmarks.reliability.fuzz_fields import make_cases, send_all
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine

    config = EngineConfig(ModelConfig(str(llava_ov_path)))
    with live(lambda: Engine(config)) as server:
        outcomes = run(send_all(server.url, make_cases(45, seed=1), concurrency=6))
        c = count(outcomes)
        assert (c["lost"], c["5xx"], c["unexpected"]) == (0, 0, 0), c["unexpected_examples"]
        assert c["4xx"] >= 15 and c["ok"] >= 15
        server.settle()
        bm = server.engine.scheduler.block_manager
        bm.check_integrity()
        assert bm.num_free_blocks == bm.num_blocks

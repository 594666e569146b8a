"""The front door's pieces that need no cluster: the ASGI hand-off (a replica answers
through the very app `vlmserve serve` runs), per-replica metric labels, and the routing
key of an image against the encoder cache's."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from encoders.images import content_hash
from scheduler.routing.route_keys import IMAGE_WEIGHT_TOKENS, keys_from_body
from vlmserve.replicas.asgi_call import call_asgi
from vlmserve.replicas.front import _merge, label_replica


def collect(app, method="POST", path="/echo", body=b"{}", headers=()):
    async def run():
        return [part async for part in call_asgi(app, method, path, b"q=1", list(headers), body)]

    return asyncio.run(run())


def test_a_json_answer_comes_back_as_head_then_body():
    app = FastAPI()

    @app.post("/echo")
    async def echo(payload: dict, q: str) -> dict:
        return {"got": payload, "q": q}

    head, *body = collect(app, body=b'{"a": 1}', headers=[("content-type", "application/json")])
    assert head["status"] == 200
    assert ("content-type", "application/json") in head["headers"]
    assert b"".join(body) == b'{"got":{"a":1},"q":"1"}'
    missing, *_ = collect(app, path="/nope")
    assert missing["status"] == 404


def test_a_stream_comes_back_chunk_by_chunk_and_an_early_stop_disconnects_the_app():
    app = FastAPI()
    seen = {}

    @app.post("/echo")
    async def stream():
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                seen["closed_at"] = i

        return StreamingResponse(events(), media_type="text/event-stream")

    async def first_three():
        out = []
        gen = call_asgi(app, "POST", "/echo", b"", [], b"")
        async for part in gen:
            out.append(part)
            if len(out) == 4:
                break
        await gen.aclose()
        return out

    head, *chunks = asyncio.run(first_three())
    assert head["status"] == 200 and chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert seen["closed_at"] < 999  # the app saw its client leave and stopped


def test_each_sample_gets_its_replica_label_and_help_lines_appear_once():
    text = (
        "# HELP reqs Requests.\n# TYPE reqs counter\n"
        'reqs{outcome="stop"} 3.0\nreqs{} 1.0\n# HELP up Up.\n# TYPE up gauge\nup 1.0\n'
    )
    a, b = label_replica(text, "r1"), label_replica(text, "r2")
    assert 'reqs{replica="r1",outcome="stop"} 3.0' in a.splitlines()
    assert 'reqs{replica="r1"} 1.0' in a.splitlines()
    assert 'up{replica="r2"} 1.0' in b.splitlines()
    merged = _merge([a, b]).splitlines()
    assert merged.count("# HELP reqs Requests.") == 1
    first = ['reqs{replica="r1",outcome="stop"} 3.0', 'reqs{replica="r1"} 1.0']
    assert merged[:4] == ["# HELP reqs Requests.", "# TYPE reqs counter", *first]
    assert merged.index('up{replica="r2"} 1.0') > merged.index("# TYPE up gauge")


def test_the_routing_key_of_an_upload_is_the_encoder_caches_content_hash():
    data = bytes(range(256)) * 7
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
        ]
    }
    [(key, _)] = keys_from_body(body).image_keys
    assert key == content_hash(data) == hashlib.blake2b(data, digest_size=16).digest()


class _Started(Exception):
    pass


def test_serve_flags_reach_the_replica_launch(monkeypatch, capsys):
    from vlmserve.cli.main import main
    from vlmserve.replicas import launch

    seen = {}

    def fake_start(engine, server, config):
        seen.update(engine=engine, server=server, config=config)
        raise _Started

    monkeypatch.setattr(launch, "start_replicas", fake_start)
    argv = ["serve", "--replicas", "3", "--router", "prefix", "--router-max-imbalance", "5",
            "--ray", "10.0.0.1:6379", "--ray-gpus-per-replica", "1", "--api-key", "k"]  # fmt: skip
    with pytest.raises(_Started):
        main(argv)
    config = seen["config"]
    assert (config.num_replicas, config.router, config.max_imbalance) == (3, "prefix", 5)
    assert (config.address, config.gpus_per_replica, config.cpus_per_replica) == (
        "10.0.0.1:6379", 1.0, 1.0)  # fmt: skip
    assert seen["server"].api_key == "k"
    with pytest.raises(_Started):  # --ray alone: a local cluster, the one-replica door
        main(["serve", "--ray"])
    assert (seen["config"].num_replicas, seen["config"].address) == (1, "local")
    assert main(["serve", "--replicas", "2", "--router-max-imbalance", "-1"]) == 2
    assert "--router-max-imbalance" in capsys.readouterr().err


class _Handle:
    """A deployment handle that answers every call 200 and keeps the routing keys."""

    def __init__(self) -> None:
        self.routes: list = []

    def options(self, **_):
        return self

    @property
    def handle_http(self):
        return self

    def remote(self, *args, route=None):
        self.routes.append(route)

        async def answer():
            yield {"status": 200, "headers": [("content-type", "application/json")]}
            yield b"{}"

        return answer()


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def test_the_front_door_weighs_an_upload_as_the_engine_counts_it_and_routes_a_bad_one():
    from fastapi.testclient import TestClient

    from vlmserve.embedded import DEFAULT_MODEL_DIR
    from vlmserve.embedded.processor import SceneProcessor
    from vlmserve.replicas.front import create_front_app
    from vlmserve.replicas.image_cost import RoutingProfile

    scene = SceneProcessor.from_pretrained(DEFAULT_MODEL_DIR)
    profile = RoutingProfile(scene.image_config.image_spec(), 10_000)
    handle = _Handle()
    client = TestClient(
        create_front_app(handle, lambda: 1, list, image_tokens=profile.image_tokens)
    )

    def post(data: bytes) -> int:
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}]
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
        return client.post("/v1/chat/completions", json=body).status_code

    for size in ((64, 64), (600, 200)):
        assert post(png(*size)) == 200
        # The embedded model's own count (SceneProcessor, the reference image path).
        assert handle.routes[-1].image_keys[0][1] == scene.num_image_tokens(*size)
    assert handle.routes[-1].image_keys[0][1] != handle.routes[-2].image_keys[0][1]
    assert post(b"\x89PNG\r\n\x1a\n broken") == 200  # routed unpriced, answered by a replica
    assert handle.routes[-1].image_keys[0][1] == IMAGE_WEIGHT_TOKENS

    def failing(data: bytes) -> int:
        raise RuntimeError("pricing broke")

    client = TestClient(create_front_app(handle, lambda: 1, list, image_tokens=failing))
    assert post(png(64, 64)) == 200
    assert handle.routes[-1].image_keys[0][1] == IMAGE_WEIGHT_TOKENS


def test_health_is_ok_while_one_replica_runs_and_503_with_none():
    from fastapi.testclient import TestClient

    from vlmserve.replicas.front import create_front_app

    running = {"n": 2}
    client = TestClient(create_front_app(_Handle(), lambda: running["n"], list))
    assert client.get("/health").json() == {"status": "ok", "replicas_running": 2}
    running["n"] = 1  # one replica dead, being restarted: still serving
    assert client.get("/health").status_code == 200
    running["n"] = 0
    answer = client.get("/health")
    assert answer.status_code == 503 and answer.json()["replicas_running"] == 0

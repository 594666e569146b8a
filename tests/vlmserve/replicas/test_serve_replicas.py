"""`vlmserve serve --replicas 2` on a real local Ray cluster: the openai client gets the
same answers (chat, streaming, images, completions, errors) as from one `vlmserve serve`
of the same model; /health and /metrics cover both replicas; a repeated image goes back
to its replica; and a replica killed mid-load ends each of its requests with a clear
error (none hangs, none is answered twice) while Ray Serve brings it back."""

from __future__ import annotations

import argparse
import base64
import io
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

import openai

from benchmarks.reliability.server import in_process_server
from vlmserve.cli import serve as serve_cli
from vlmserve.cli.engine_args import engine_config_from_args
from vlmserve.cli.serve_replicas import front_door
from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.embedded.processor import SceneProcessor
from vlmserve.embedded.scenes import generate_scene, render_scene
from vlmserve.engine.core import Engine
from vlmserve.replicas import launch
from vlmserve.server.app import ServerConfig, create_app

pytestmark = pytest.mark.slow
MODEL = "m"
FLAGS = ["--preprocess-workers", "0", "--no-warmup", "--max-num-seqs", "8"]


def engine_config():
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    return engine_config_from_args(parser.parse_args(["serve", *FLAGS]))


@pytest.fixture(scope="module")
def servers():
    import ray

    config = engine_config()
    server = ServerConfig(model_name=MODEL)
    # A wide load bound: affinity always wins here, whatever the earlier tests' routing
    # left in the router's shares (the bound itself is tested on the pure policy).
    replicas = launch.ReplicaConfig(
        num_replicas=2, health_check_period_s=1.0, seed=0, load_factor=4.0
    )
    handle = launch.start_replicas(config, server, replicas)
    front = front_door(handle, server)  # as `vlmserve serve --replicas 2` builds it
    single = create_app(lambda: Engine(config), server)
    try:
        with in_process_server(front) as front_url, in_process_server(single) as single_url:
            yield front_url, single_url
    finally:
        launch.stop()
        assert not ray.is_initialized()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


SCENE_SIZE = render_scene(generate_scene(0)).size


def scene_url(seed: int) -> str:
    image = render_scene(generate_scene(seed))
    assert image.size == SCENE_SIZE
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat(seed: int, question: str) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": scene_url(seed)}}
    return [{"role": "user", "content": [image, {"type": "text", "text": question}]}]


TEXT = [{"role": "user", "content": "Describe the image."}]


def answer(url: str, messages: list[dict], **kw):
    out = client(url).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, **kw
    )
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.prompt_tokens


def streamed(url: str, messages: list[dict]) -> tuple[str, list[str]]:
    chunks = client(url).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    text, reasons = "", []
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    return text, reasons


def test_two_replicas_answer_as_one_server_does(servers):
    front, single = servers
    for messages in (TEXT, image_chat(3, "What colour is the shape?"), image_chat(5, "Describe.")):
        assert answer(front, messages) == answer(single, messages)
        assert streamed(front, messages) == streamed(single, messages)
    done = [client(u).completions.create(model=MODEL, prompt="a red", max_tokens=8, temperature=0)
            for u in (front, single)]  # fmt: skip
    assert done[0].choices[0].text == done[1].choices[0].text
    bad = {"model": MODEL, "messages": TEXT, "max_tokens": -1}
    refused = [httpx.post(u + "/v1/chat/completions", json=bad, timeout=60) for u in servers]
    assert refused[0].status_code == refused[1].status_code == 422
    assert refused[0].json() == refused[1].json()
    tokens = [httpx.post(u + "/tokenize", json={"prompt": "a red square"}).json() for u in servers]
    assert tokens[0] == tokens[1]


def test_health_metrics_and_a_repeated_image_goes_back_to_its_replica(servers):
    front, _ = servers
    assert httpx.get(front + "/health").json() == {"status": "ok", "replicas_running": 2}
    before = launch.router_decisions()
    long_question = "Which colour is the large shape in this picture, and where does it sit?"
    for _ in range(3):
        answer(front, image_chat(11, long_question))
    after = launch.router_decisions()
    assert after.get("image", 0) - before.get("image", 0) == 2  # the 2nd and 3rd
    # The router models each replica's encoder cache at the size the replicas reported,
    # the image weighed in the visual tokens the embedded model gives it.
    router = launch._ROUTERS[launch.DEPLOYMENT_NAME]
    size = launch.routing_profile().encoder_cache_tokens
    assert size is not None and router.policy.config.encoder_cache_tokens == size
    tokens = SceneProcessor.from_pretrained(DEFAULT_MODEL_DIR).num_image_tokens(*SCENE_SIZE)
    assert {w for lru in router.policy._encoded.values() for w in lru.values()} == {tokens}
    # A conversation (the OpenAI `user` field) stays on its replica.
    before = launch.router_decisions()
    for _ in range(3):
        answer(front, TEXT, user="conversation-1")
    assert launch.router_decisions().get("session", 0) - before.get("session", 0) == 2
    text = httpx.get(front + "/metrics", timeout=30).text
    ids = launch.live_replica_ids()
    assert len(ids) == 2
    for rid in ids:  # every replica's series, each labelled (a counter every engine has)
        assert f'vlmserve_recomputed_tokens_total{{replica="{rid}"}} ' in text
    served = [f'vlmserve_requests_total{{replica="{rid}",outcome="length"}}' in text for rid in ids]
    assert any(served)  # the requests above, counted by the replica that served them
    assert "vlmserve_replicas_running 2" in text


def test_a_replica_killed_mid_load_ends_its_requests_clearly_and_comes_back(servers):
    import ray
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX

    front, _ = servers
    before = set(launch.live_replica_ids())
    outcomes: dict[int, tuple] = {}
    started = [threading.Event() for _ in range(6)]

    def one(i: int) -> None:
        text, reasons, error = "", [], None
        try:
            stream = client(front).chat.completions.create(
                model=MODEL, messages=image_chat(100 + i, "Describe the image."),
                max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    started[i].set()
                    reasons += [choice.finish_reason] if choice.finish_reason else []
        except openai.APIError as e:
            error = str(e)
        outcomes[i] = (text, reasons, error)
        started[i].set()  # a request that failed early does not hold the kill back

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    # Every request routed and decoding (its first tokens out, 400 to go): a fixed sleep
    # let the quiet machine finish them all before the kill.
    for event in started:
        event.wait(timeout=120)
    victim = sorted(before)[0]
    name = f"{REPLICA_ID_FULL_ID_STR_PREFIX}{launch.APP_NAME}#{launch.DEPLOYMENT_NAME}#{victim}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    errors = [o for o in outcomes.values() if o[2] is not None]
    answered = [o for o in outcomes.values() if o[2] is None]
    assert errors, "the kill met no request in flight"
    for _, reasons, error in errors:
        assert "replica serving this request failed" in error and reasons == []
    for _, reasons, _ in answered:
        assert reasons == ["length"]  # exactly one end, no second answer
    # Back: Serve counts 2 running, then the router hears of the new one (a long poll from
    # the controller, a moment later: once it was asserted in between and failed).
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (
        launch.num_running() < 2 or len(set(launch.live_replica_ids()) - {victim}) < 2
    ):
        time.sleep(1.0)
    assert launch.num_running() == 2
    after = set(launch.live_replica_ids())
    assert victim not in after and len(after) == 2
    # The router's state survived the restart: the survivor's entries kept, the victim's gone.
    images = launch._ROUTERS[launch.DEPLOYMENT_NAME].policy._images
    assert images and all(victim not in held for held in images.values())
    assert answer(front, TEXT)[1] == "length"

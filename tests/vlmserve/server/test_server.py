"""The HTTP server, end to end: a real uvicorn on 127.0.0.1 (free port), the official
`openai` client for the happy paths and raw httpx for the error cases. Answers of the
tiny random checkpoint are noise, so the tests check the mechanics exactly against the
offline engine: token counts, usage, finish reasons, streamed == non-streamed. Fetches over
loopback, loading and draining: tests/vlmserve/server/test_server_lifecycle.py."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

# The server's libraries (and the client these tests drive it with): skip, not error,
# where only the engine is installed (a GPU machine's own environment).
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from server_testing import (
    KEY,
    MODEL,
    Served,
    all_blocks_free,
    assert_error,
    data_url,
    engine_config,
    greedy,
    png,
    serve,
    user,
    wait_until,
)

from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.server.media import MediaPolicy, file_url


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def served(llava_ov_path, media_dir) -> Iterator[Served]:
    """Default media rules (no loopback), an API key, small caps to test the 413s. Its
    engine schedules asynchronously, the `offline` one in turn: the answers must agree."""
    media = MediaPolicy(allowed_local_dir=str(media_dir), max_image_pixels=20_000)
    config = engine_config(llava_ov_path, async_scheduling=True)
    with serve(
        lambda: Engine(config), api_key=KEY, media=media, max_images_per_request=4,
        max_body_bytes=1 << 20,
    ) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def offline(llava_ov_path) -> Engine:
    return Engine(engine_config(llava_ov_path))


def to_engine(messages: list[dict]) -> list[dict]:
    """The same messages as the offline engine takes them (image bytes inline)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": base64.b64decode(p["image_url"]["url"].split(",")[1])}
                if p["type"] == "image_url"
                else p
                for p in content
            ]
        out.append({"role": m["role"], "content": content})
    return out


def offline_answer(engine: Engine, messages: list[dict], max_tokens: int, **sampling):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    [out] = engine.generate([Request(to_engine(messages), sampling=params)])
    assert out.error is None, out.error
    return out


# --- the happy paths with the openai client -------------------------------------------------


def test_health_and_models(served):
    assert httpx.get(served.url("/health")).json() == {"status": "ok"}
    assert [m.id for m in served.client().models.list()] == [MODEL]


def test_answer_and_usage_match_the_offline_engine(served, offline, random_image):
    messages = [user("what colour is the star", png(random_image, 1))]
    ref = offline_answer(offline, messages, 12, ignore_eos=True)
    reply = served.client().chat.completions.create(messages=messages, **greedy(12))
    assert reply.choices[0].message.content == ref.text
    assert reply.choices[0].finish_reason == "length"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (ref.num_prompt_tokens, 12)
    assert usage.total_tokens == ref.num_prompt_tokens + 12
    details = usage.prompt_tokens_details
    assert details.image_tokens == ref.num_image_tokens > 0
    assert details.text_tokens == ref.num_prompt_tokens - ref.num_image_tokens
    # max_completion_tokens is the newer name of the same limit.
    reply = served.client().chat.completions.create(
        messages=messages, model=MODEL, temperature=0, max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.usage.completion_tokens == 5
    assert ref.text.startswith(reply.choices[0].message.content)


def test_stream_equals_the_non_streamed_answer(served, random_image):
    messages = [user("where is the blue circle", png(random_image, 2))]
    client = served.client()
    whole = client.chat.completions.create(messages=messages, **greedy(16))
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **greedy(16)
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in with_choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert len({c.id for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    # The second ask of the same image prefix comes from the prefix cache.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens >= (
        whole.usage.prompt_tokens_details.image_tokens
    )


def test_raw_stream_is_sse_ending_with_done(served, random_image):
    body = {"model": MODEL, "messages": [user("describe", png(random_image, 3))],
            "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", served.url("/v1/chat/completions"), json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["usage"] is None for p in payloads)  # include_usage not asked


def test_stop_string_cuts_both_ways_alike(served, offline, random_image):
    messages = [user("how many squares", png(random_image, 4))]
    full = offline_answer(offline, messages, 12, ignore_eos=True).text
    stop = " " + full.split()[2]
    expected = full[: full.find(stop)]
    client = served.client()
    reply = client.chat.completions.create(messages=messages, stop=[stop], **greedy(12))
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(messages=messages, stop=stop, stream=True, **greedy(12))
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_multi_turn_several_images_and_prefix_cache(served, offline, random_image):
    a, b, c = (png(random_image, 10 + i, 40 + 10 * i, 40) for i in range(3))
    history = [
        {"role": "system", "content": "you describe pictures"},
        user("compare these", a, b),
        {"role": "assistant", "content": "the left one is red"},
    ]
    client = served.client()
    for question in ("and this one", "how many circles"):
        messages = [*history, user(question, c)]
        ref = offline_answer(offline, messages, 6, ignore_eos=True)
        reply = client.chat.completions.create(messages=messages, **greedy(6))
        assert reply.choices[0].message.content == ref.text
        assert reply.usage.prompt_tokens == ref.num_prompt_tokens
        assert reply.usage.prompt_tokens_details.image_tokens == ref.num_image_tokens
    # The second question shares everything up to its last turn with the first one.
    assert reply.usage.prompt_tokens_details.cached_tokens > ref.num_image_tokens // 2


def test_concurrent_streams_interleave_and_match_alone(served, offline, random_image):
    requests = [
        [user("where is the star", png(random_image, 20 + i))] if i % 2 else
        [{"role": "user", "content": f"tell me a word {i}"}]
        for i in range(4)
    ]  # fmt: skip
    # Long enough answers that every stream's window spans the others' preparation.
    refs = [offline_answer(offline, m, 64, ignore_eos=True).text for m in requests]
    arrivals: dict[int, list[float]] = {i: [] for i in range(4)}
    texts: dict[int, str] = {}
    client = served.client()

    def run(i: int) -> None:
        stream = client.chat.completions.create(messages=requests[i], stream=True, **greedy(64))
        parts = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals[i].append(time.monotonic())
                parts.append(chunk.choices[0].delta.content)
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [texts[i] for i in range(4)] == refs
    # Interleaved: every stream got a token before any other stream was done.
    assert max(a[0] for a in arrivals.values()) < min(a[-1] for a in arrivals.values())
    assert wait_until(lambda: all_blocks_free(served))


# --- errors: OpenAI error shape, right status, nothing else disturbed ----------------------


def test_api_key_is_required_on_v1_routes(served):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    error = assert_error(served.post(body, key="wrong"), 401, "API key")
    assert error["type"] == "authentication_error"
    assert_error(served.post(body, key=None), 401)
    assert_error(httpx.get(served.url("/v1/models")), 401)
    assert httpx.get(served.url("/health")).status_code == 200  # not under /v1


def test_malformed_and_schema_violating_requests(served):
    assert_error(served.post(b'{"model": "x", "messages": [}'), 400, "malformed JSON")
    assert_error(served.post({"model": MODEL}), 422, "messages")
    bad_temperature = {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}
    assert_error(served.post(bad_temperature), 422, "temperature")
    audio = {"messages": [{"role": "user", "content": [{"type": "input_audio", "x": 1}]}]}
    assert_error(served.post(audio), 422)
    assert_error(served.post({"messages": [{"role": "user", "content": "hi"}], "n": 0}), 400, "n=0")
    unknown = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(served.post(unknown), 404, "gpt-9")


def test_bad_images_are_4xx(served, random_image):
    def ask(url: str) -> httpx.Response:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
        return served.post({"messages": [{"role": "user", "content": parts}], "max_tokens": 2})

    assert_error(ask(data_url(b"\xff\xd8\xff\xe0 not really a jpeg")), 400, "cannot decode")
    assert_error(ask(data_url(png(random_image, 5, 200, 150))), 413, "pixels")
    too_many = [user("four is the cap", *[png(random_image, i, 32, 32) for i in range(5)])]
    assert_error(served.post({"messages": too_many}), 400, "5 images, the limit is 4")
    big = {"messages": [user("x" * (2 << 20))]}
    assert_error(served.post(big), 413, "body")


def test_unsafe_urls_are_refused_before_any_connection(served, media_dir, random_image):
    hits = []

    class Sentinel(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(500)
            self.end_headers()

    sentinel = ThreadingHTTPServer(("127.0.0.1", 0), Sentinel)
    threading.Thread(target=sentinel.serve_forever, daemon=True).start()
    port = sentinel.server_address[1]

    def ask(url: str) -> httpx.Response:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
        return served.post({"messages": [{"role": "user", "content": parts}], "max_tokens": 2})

    try:
        private = [
            f"https://127.0.0.1:{port}/a.png",
            f"https://[::1]:{port}/a.png",
            "https://10.0.0.7/a.png",
            "https://169.254.169.254/latest/meta-data",
        ]
        for url in private:
            assert_error(ask(url), 400, "non-public address")
        assert_error(ask(f"http://127.0.0.1:{port}/a.png"), 400, "scheme 'http'")
        assert_error(ask(f"file://{media_dir}/../secret.png"), 400, "outside the allowed")
    finally:
        sentinel.shutdown()
        sentinel.server_close()
    assert hits == []
    (media_dir / "ok.png").write_bytes(png(random_image, 6))
    reply = served.client().chat.completions.create(
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": file_url(media_dir / "ok.png")}},
            {"type": "text", "text": "what is it"}]}],
        **greedy(3),
    )  # fmt: skip
    assert reply.usage.prompt_tokens_details.image_tokens > 0


def test_disconnect_mid_stream_frees_the_kv_blocks(served, random_image):
    body = {"messages": [user("describe at length", png(random_image, 7))], "max_tokens": 3000,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", served.url("/v1/chat/completions"), json=body, headers=headers) as r:
        events = []
        for line in r.iter_lines():
            events += [line] if line.startswith("data: ") else []
            if len(events) >= 6:
                break
        assert served.stats()["used_blocks"] > 0
    # Closed after a few tokens: the request is aborted, its blocks return to the pool.
    assert wait_until(lambda: all_blocks_free(served), timeout=10)
    assert served.app.state.metrics.requests.value(outcome="abort") >= 1
    # A non-streaming client that gives up is noticed too (polled every 0.25 s).
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        served.post(body, timeout=1.0)
    assert wait_until(lambda: all_blocks_free(served), timeout=10)


def test_server_keeps_serving_after_errors(served, random_image):
    served.post(b"{not json")
    served.post({"messages": [user("bad", b"garbage")]})
    reply = served.client().chat.completions.create(
        messages=[user("still there?", png(random_image, 8))], **greedy(3)
    )
    assert reply.usage.completion_tokens == 3
    assert wait_until(lambda: all_blocks_free(served))


def test_metrics_exposition(served):
    text = httpx.get(served.url("/metrics")).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['vlmserve_requests_total{outcome="length"}'] >= 5
    assert samples['vlmserve_requests_total{outcome="http_401"}'] >= 1
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert f"# TYPE vlmserve_{hist}_seconds histogram" in text
        count = samples[f"vlmserve_{hist}_seconds_count"]
        assert count >= 5 and samples[f'vlmserve_{hist}_seconds_bucket{{le="+Inf"}}'] == count
    for hist in ("time_to_first_token", "time_per_output_token"):  # per class as well
        by_class = {
            cls: samples[f'vlmserve_{hist}_by_class_seconds_count{{class="{cls}"}}']
            for cls in ("text", "image")
        }
        assert min(by_class.values()) >= 1
        assert sum(by_class.values()) == samples[f"vlmserve_{hist}_seconds_count"]
    assert samples['vlmserve_preprocess_seconds_count{stage="fetch"}'] >= 5
    assert samples['vlmserve_preprocess_seconds_count{stage="process"}'] >= 5
    assert samples["vlmserve_num_kv_blocks"] == 1024
    assert samples["vlmserve_prefix_cache_hit_tokens_total"] > 0
    # Every image went through the encoder-output cache; the repeated one hit it.
    assert samples["vlmserve_encoder_cache_misses_total"] >= 1
    assert samples["vlmserve_encoder_cache_hits_total"] >= 1
    assert samples["vlmserve_encoder_cache_bytes"] > 0
    assert samples["vlmserve_preprocess_decode_seconds_total"] > 0
    for gauge in ("num_requests_waiting", "num_requests_running", "kv_blocks_used"):
        assert f"vlmserve_{gauge}" in samples

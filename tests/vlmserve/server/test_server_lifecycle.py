"""The HTTP server's life around the requests: image fetches over an allowed loopback
(timeouts, unreachable hosts, the fetch queue bound), /health while loading and draining,
the embedded default model behind the server, and requests refused before or while
streaming. Each test runs its own server (tests/vlmserve/server/test_server.py shares one)."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from server_testing import (
    KEY,
    MODEL,
    all_blocks_free,
    assert_error,
    data_url,
    engine_config,
    png,
    serve,
    user,
    wait_until,
)

from vlmserve.engine.core import Engine
from vlmserve.server.media import MediaPolicy

# --- media over loopback (explicitly allowed), queue bound, loading and draining -----------


class _ImageHost(BaseHTTPRequestHandler):
    image = b""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/slow"):
            time.sleep(2.0)
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.image)))
            self.end_headers()
            self.wfile.write(self.image)
        except OSError:
            pass  # /slow: the server gave up on us (504) and closed the connection


def test_fetch_over_allowed_loopback_timeout_unreachable_and_queue_bound(
    llava_ov_path, random_image
):
    _ImageHost.image = png(random_image, 9)
    host = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHost)
    host.daemon_threads = True
    threading.Thread(target=host.serve_forever, daemon=True).start()
    # A port held bound but not listening for the whole test: connects to it are refused,
    # and no other socket (another test's image host) can take it meanwhile.
    closed_socket = socket.socket()
    closed_socket.bind(("127.0.0.1", 0))
    closed = closed_socket.getsockname()[1]
    media = MediaPolicy(allowed_networks=("127.0.0.1/32",), allow_http=True, timeout_s=0.5)
    factory = lambda: Engine(engine_config(llava_ov_path))
    with closed_socket, serve(factory, media=media, max_pending_requests=2) as served:
        base = f"http://127.0.0.1:{host.server_address[1]}"

        def ask(url: str, **kw) -> httpx.Response:
            parts = [{"type": "image_url", "image_url": {"url": url}},
                     {"type": "text", "text": "hi"}]  # fmt: skip
            body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 3,
                    "temperature": 0, "ignore_eos": True, **kw}  # fmt: skip
            return served.post(body)

        fetched = ask(base + "/a.png")
        inline = ask(data_url(_ImageHost.image))
        assert fetched.status_code == 200, fetched.text
        assert fetched.json()["choices"] == inline.json()["choices"]
        assert_error(ask(base + "/slow.png"), 504, "took over 0.5 s")
        assert_error(ask(f"http://127.0.0.1:{closed}/a.png"), 400, "cannot fetch")
        # Bounded admission: two long streams fill it, the third is refused with 429.
        body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000,
                "stream": True, "ignore_eos": True}  # fmt: skip
        with contextlib.ExitStack() as stack:
            held = []  # the line iterators: dropping one would close its connection
            for _ in range(2):
                r = stack.enter_context(
                    httpx.stream("POST", served.url("/v1/chat/completions"), json=body)
                )
                held.append(r.iter_lines())
                assert next(held[-1]).startswith("data: ")
            assert served.app.state.engine_loop.num_pending == 2
            busy = served.post({"messages": [{"role": "user", "content": "me too"}]})
            assert_error(busy, 429, "in flight")
            assert busy.headers["retry-after"] == "1"
        assert wait_until(lambda: all_blocks_free(served))
        assert ask(data_url(_ImageHost.image)).status_code == 200
    host.shutdown()
    host.server_close()


def test_health_is_503_while_loading_and_draining(llava_ov_path):
    gate = threading.Event()

    def slow_factory() -> Engine:
        assert gate.wait(30)
        return Engine(engine_config(llava_ov_path, num_blocks=64))

    with serve(slow_factory, wait_ready=False) as served:
        loading = httpx.get(served.url("/health"))
        assert (loading.status_code, loading.json()["status"]) == (503, "loading")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert_error(served.post(chat, key=None), 503, "loading")
        gate.set()
        assert wait_until(lambda: httpx.get(served.url("/health")).status_code == 200)
        assert served.post(chat, key=None).status_code == 200
        served.app.state.engine_loop.begin_drain()
        draining = httpx.get(served.url("/health"))
        assert (draining.status_code, draining.json()["status"]) == (503, "draining")
        assert_error(served.post(chat, key=None), 503, "draining")


def test_embedded_model_answers_a_question_about_a_generated_scene():
    from vlmserve.embedded import DEFAULT_MODEL_DIR
    from vlmserve.embedded.evaluate import CAPTION_PROMPT, heldout_scenes
    from vlmserve.embedded.scenes import caption, render_scene

    scene = heldout_scenes(1, multi_tile=True)[0]
    buf = io.BytesIO()
    render_scene(scene).save(buf, "PNG")
    with serve(lambda: Engine(engine_config(DEFAULT_MODEL_DIR)), api_key=KEY) as s:
        reply = s.client().chat.completions.create(
            model=MODEL, messages=[user(CAPTION_PROMPT, buf.getvalue())], max_tokens=40,
            temperature=0,
        )  # fmt: skip
    assert reply.choices[0].message.content.strip() == caption(scene)
    assert reply.choices[0].finish_reason == "stop"


def test_never_fitting_request_is_400_and_a_bad_streamed_image_is_4xx(llava_ov_path, random_image):
    with serve(lambda: Engine(engine_config(llava_ov_path, num_blocks=12))) as small:
        body = {"messages": [user("hi")], "max_tokens": 60}
        assert_error(small.post(body), 400, r"60 output tokens), the KV pool holds 12")
        # A header that reads fine and a body that does not: the decode fails after the
        # request was queued, and the stream still answers with a JSON error.
        buffer = io.BytesIO()
        random_image(3, 48, 48).save(buffer, format="JPEG")
        truncated = buffer.getvalue()[:300]
        parts = [{"type": "image_url", "image_url": {"url": data_url(truncated)}},
                 {"type": "text", "text": "hi"}]  # fmt: skip
        stream = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2,
                  "stream": True}  # fmt: skip
        assert_error(small.post(stream), 400, "image")

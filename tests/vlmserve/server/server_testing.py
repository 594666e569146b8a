"""What the server tests share: an app on a real uvicorn (loopback, free port) with its
client helpers, a small engine config, request bodies, and the OpenAI error check."""

from __future__ import annotations

import base64
import contextlib
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

# The server's libraries and the client the tests drive it with: a test module importing
# this skips, not errors, where they are missing (a GPU machine's own environment).
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from fastapi import FastAPI
from openai import OpenAI

from benchmarks.reliability.server import in_process_server
from scheduler.config import CacheConfig, SchedulerConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.server.app import ServerConfig, create_app

KEY = "sk-test-key"
MODEL = "tiny-llava"


@dataclass
class Served:
    base_url: str
    app: FastAPI

    def client(self, **kw) -> OpenAI:
        return OpenAI(base_url=self.base_url + "/v1", api_key=KEY, max_retries=0, **kw)

    def post(self, body, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kw.setdefault("timeout", 60)
        if isinstance(body, (bytes, str)):
            headers["Content-Type"] = "application/json"
            return httpx.post(self.url("/v1/chat/completions"), content=body, headers=headers, **kw)
        return httpx.post(self.url("/v1/chat/completions"), json=body, headers=headers, **kw)

    def url(self, path: str) -> str:
        return self.base_url + path

    def stats(self) -> dict[str, float]:
        return self.app.state.engine_loop.stats()


def engine_config(path, num_blocks: int = 1024, async_scheduling: bool = False) -> EngineConfig:
    return EngineConfig(
        ModelConfig(str(path)),
        CacheConfig(num_blocks=num_blocks, block_size=4),
        SchedulerConfig(
            max_num_batched_tokens=256, max_num_seqs=16, async_scheduling=async_scheduling
        ),
    )


@contextlib.contextmanager
def serve(factory, wait_ready: bool = True, on_engine_death=None, **options) -> Iterator[Served]:
    app = create_app(factory, ServerConfig(model_name=MODEL, **options), on_engine_death)
    with in_process_server(app, wait_ready) as url:
        yield Served(url, app)


def png(random_image, seed: int, width: int = 60, height: int = 40) -> bytes:
    buf = io.BytesIO()
    random_image(seed, width, height).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(text: str, *images: bytes) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def greedy(max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "extra_body": {"ignore_eos": True, **extra}}  # fmt: skip


def wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def all_blocks_free(served: Served) -> bool:
    stats = served.stats()
    return stats["free_blocks"] == stats["num_blocks"] and stats["pending"] == 0


def assert_error(response: httpx.Response, status: int, match: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert match.lower() in error["message"].lower(), error["message"]
    return error

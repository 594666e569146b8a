"""The scaled-down lumpy mix over HTTP, for benchmarks/serving/sim_vs_real.py.

Requests are built before the clock starts (text chat as Poisson arrivals, bursts of
3-image requests with real PNGs of 13 tiles each), sent at their times by one asyncio
client and measured there (TTFT: the stream opens with the first token), with the usage
the server reports; and requests sent one at a time to the idle server, with what its
/metrics say meanwhile. The server is the reliability suite's `ServerProcess`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import time
from pathlib import Path

import httpx

from benchmarks.reliability.common import data_url, png_bytes, user_message
from benchmarks.reliability.server import ServerProcess, children_of
from vlmserve.embedded import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]
WORDS = "where is the red star and how many blue circles are on the left of a green square"
# The lumpy_admission mix scaled down (there: 10 text req/s with 20-400 prompt and 32-256
# output tokens; 40 requests of 4 x 13-tile images, 3.2x the pool). The embedded model's
# context is 512 tokens: 3 images of 117 tokens is the most a request can carry.
# Two bursts (as lumpy_admission's burst-every-60s workload, and so the burst class's p50
# is over 24 requests rather than 12).
TEXT_RATE = 4.0
DURATION_S = 45.0
BURSTS_AT = (12.0, 30.0)
NUM_BURST = 12  # per burst
BURST_WINDOW_S = 1.0
IMAGES_PER_BURST_REQUEST = 3
IMAGE_SIZE = (192, 144)  # InternVL grid 4x3 + the thumbnail: 13 tiles of 48 px
TOKENS_PER_TILE = 9  # 36 patches, 2x2 pixel shuffle
NUM_KV_BLOCKS = 160  # 2,560 tokens: the burst asks for ~1.9x that
SERVER_FLAGS = ["--num-kv-blocks", str(NUM_KV_BLOCKS), "--admission", "lumpy"]


@dataclasses.dataclass(frozen=True)
class Planned:
    """One request of the load, built before the clock starts."""

    request_id: str
    at_s: float
    request_class: str
    body: dict
    tiles: tuple[int, ...]  # per image
    images: tuple[str, ...] = ()  # per image: its content's digest (the trace's image key)


@dataclasses.dataclass
class Measured:
    request_id: str
    request_class: str
    sent_s: float  # since the load started
    tiles: tuple[int, ...]
    images: tuple[str, ...] = ()
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    image_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


# --- the load ---------------------------------------------------------------------------


def png(width: int, height: int, seed: int) -> bytes:
    return png_bytes(seed, width, height)


def digest(image: bytes) -> str:
    """An image's key in the simulated trace: equal bytes, equal key (a repeat is a hit in
    the simulator's encoder and prefix caches, as in the server's)."""
    return hashlib.sha256(image).hexdigest()[:16]


def body(num_words: int, max_tokens: int, images: list[bytes], rng: random.Random) -> dict:
    words = WORDS.split()
    text = " ".join(rng.choice(words) for _ in range(num_words))
    return {
        "messages": user_message(text, [data_url(im) for im in images]),
        "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip


def image_tiles(width: int, height: int) -> int:
    from vlmserve.embedded.processor import SceneProcessor

    return SceneProcessor.from_pretrained(DEFAULT_MODEL_DIR).num_tiles(width, height)


def plan_load(
    seed: int, duration_s: float = DURATION_S, bursts_at: tuple[float, ...] = BURSTS_AT
) -> list[Planned]:
    """Poisson text chat (8-60 words, 8-32 output tokens) for `duration_s` plus NUM_BURST
    3-image requests within BURST_WINDOW_S of each of `bursts_at`; every image new (no
    encoder or prefix cache hits between them)."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(TEXT_RATE)
    while t < duration_s:
        text = body(rng.randint(8, 60), rng.randint(8, 32), [], rng)
        out.append(Planned(f"t{len(out)}", t, "text", text, ()))
        t += rng.expovariate(TEXT_RATE)
    tiles = image_tiles(*IMAGE_SIZE)
    for k, burst_at in enumerate(bursts_at):
        for j in range(NUM_BURST):
            at = burst_at + rng.random() * BURST_WINDOW_S
            # Distinct for every (seed, burst, request, image): 12 requests of 3 images
            # once had seeds 1000s + 100k + 10j + i, and burst 1's first two requests
            # repeated burst 0's last two (encoder and prefix cache hits in the server).
            seeds = [1_000_000 * seed + 10_000 * k + 10 * j + i
                     for i in range(IMAGES_PER_BURST_REQUEST)]  # fmt: skip
            pngs = [png(*IMAGE_SIZE, s) for s in seeds]
            request = body(rng.randint(4, 10), rng.randint(8, 32), pngs, rng)
            name = f"b{j}" if k == 0 else f"b{k}.{j}"
            out.append(Planned(name, at, "3x13-tile", request, (tiles,) * len(pngs),
                               tuple(digest(p) for p in pngs)))  # fmt: skip
    return sorted(out, key=lambda p: p.at_s)


async def send(client: httpx.AsyncClient, p: Planned, start: float) -> Measured:
    await asyncio.sleep(max(0.0, start + p.at_s - time.perf_counter()))
    sent = time.perf_counter()
    m = Measured(p.request_id, p.request_class, sent - start, p.tiles, p.images)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=p.body) as response:
            if response.status_code != 200:
                m.error = (await response.aread()).decode()[:200]
                return m
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                # The stream opens (role chunk, then the first text) once the first token
                # exists: the first chunk is the first token.
                m.ttft_s = m.ttft_s or time.perf_counter() - sent
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    m.prompt_tokens, m.completion_tokens = (
                        usage["prompt_tokens"], usage["completion_tokens"],
                    )  # fmt: skip
                    m.image_tokens = details.get("image_tokens", 0)
                    m.cached_tokens = details.get("cached_tokens", 0)
    except httpx.HTTPError as e:
        m.error = repr(e)
    m.e2e_s = time.perf_counter() - sent
    return m


async def run_load(url: str, planned: list[Planned]) -> list[Measured]:
    limits = httpx.Limits(max_connections=len(planned))
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.perf_counter() + 0.2
        return list(await asyncio.gather(*(send(client, p, start) for p in planned)))


async def run_one_by_one(url: str, planned: list[Planned], gap_s: float = 0.05) -> list[Measured]:
    """`planned` sent one after the other on one kept-alive connection (as the load's
    requests mostly find one), each after the previous has finished; the first one only
    opens the connection and is not returned."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        out = []
        for p in [planned[0], *planned]:
            await asyncio.sleep(gap_s)
            out.append(await send(client, p, time.perf_counter() - p.at_s))
        return out[1:]


# --- the idle server ---------------------------------------------------------------------


def mean_between(before: dict, after: dict, name: str, labels: str = "") -> float | None:
    """Mean of histogram `name` over the observations made between two scrapes."""
    n = after.get(f"{name}_count{labels}", 0.0) - before.get(f"{name}_count{labels}", 0.0)
    total = after.get(f"{name}_sum{labels}", 0.0) - before.get(f"{name}_sum{labels}", 0.0)
    return total / n if n else None


def probe_idle(server: ServerProcess, seed: int, num_text: int = 16, num_image: int = 4):
    """Requests sent one at a time to the idle, warm server: their measurements, and the
    server's own means meanwhile (its TTFT from the handler's start; the preparer
    thread's template/tokenise/header step)."""
    rng = random.Random(seed + 7)
    tiles = image_tiles(*IMAGE_SIZE)
    probes = [Planned(f"p{i}", 0.0, "text", body(rng.randint(8, 60), 2, [], rng), ())
              for i in range(num_text)]  # fmt: skip
    for i in range(num_image):  # the burst's shape: its extra latency per image
        pngs = [png(*IMAGE_SIZE, 9_000 + 10 * i + k) for k in range(IMAGES_PER_BURST_REQUEST)]
        probes.append(Planned(f"q{i}", 0.0, "3x13-tile", body(6, 2, pngs, rng),
                              (tiles,) * len(pngs), tuple(digest(p) for p in pngs)))  # fmt: skip
    before = server.metrics()
    measured = asyncio.run(run_one_by_one(server.url, probes))
    after = server.metrics()
    histogram = "vlmserve_preprocess_seconds"
    means = {
        "server_ttft_s": mean_between(before, after, "vlmserve_time_to_first_token_seconds"),
        "process_s": mean_between(before, after, histogram, '{stage="process"}'),
    }
    return measured, means


# --- the machine's other work -----------------------------------------------------------


def _busy_jiffies() -> int:
    """CPU time the whole machine spent busy (or stolen by the hypervisor), all cores."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq + steal


def _tree_jiffies(pid: int) -> int:
    """CPU time of `pid` and its descendants alive now (utime + stime)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(stat[11]) + int(stat[12])
        todo += children_of(p)
    return total


class OtherWork:
    """Share of the machine's CPU that processes other than this one and its descendants
    (the server, its preprocessing workers) used during a `with` block: the load this
    benchmark does not model. `share` is 0..1 of all cores over the block's wall time."""

    def __enter__(self) -> OtherWork:
        self._t0, self._busy0 = time.perf_counter(), _busy_jiffies()
        self._ours0 = _tree_jiffies(os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        # A descendant that exited meanwhile drops out of the sum: none does in a run.
        ours = _tree_jiffies(os.getpid()) - self._ours0
        other = max(0, _busy_jiffies() - self._busy0 - ours)
        hz, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
        self.cpu_s = other / hz
        self.share = self.cpu_s / (wall * cores)

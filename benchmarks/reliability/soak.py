"""Soak: thousands of mixed requests against `vlmserve serve` on loopback.

The mix: text only, 1-4 fresh images, a repeated image (prefix and encoder cache hits),
bad images (10%), streamed and not, and random client disconnects (a stream cut after a
few chunks, a plain request given up on). Pass: every request has a terminal answer
(0 lost), 0 5xx, every bad image a 4xx with a message; after it, the KV pool's free
count back to its start and `check_integrity()` clean, RSS within 10% of RSS after the
warm-up, no leftover /dev/shm blocks (during the run: at most one per live worker;
after exit: none), and the server still up.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.reliability.common import (
    Outcome,
    chat_body,
    client,
    count,
    data_url,
    png_bytes,
    print_table,
    prompt_text,
    user_message,
)
from benchmarks.reliability.server import ServerProcess, shm_blocks

KINDS = (("text", 0.30), ("images", 0.40), ("repeat", 0.10), ("bad_image", 0.10),
         ("disconnect", 0.10))  # fmt: skip
SIZES = ((48, 48), (64, 48), (96, 64), (40, 80))


@dataclass
class SoakConfig:
    num_requests: int = 5000
    num_warmup: int = 200
    concurrency: int = 16
    stream_fraction: float = 0.4
    max_tokens: tuple[int, int] = (2, 12)
    rss_tolerance: float = 0.10
    seed: int = 0
    server_args: tuple[str, ...] = ("--default-max-tokens", "16")
    bad_images: list[tuple[str, bytes]] = field(default_factory=list)  # (kind, bytes)
    model_label: tuple[str, str] = ("", "")  # (a temporary path, its name in the results)


def fallback_bad_images() -> list[tuple[str, bytes]]:
    """A few bad payloads, for the quick test (the corpus has hundreds)."""
    good = png_bytes(7)
    return [("truncated_png", good[: len(good) // 2]), ("empty", b""),
            ("random_bytes", random.Random(1).randbytes(2000)), ("text", b"not an image"),
            ("png_header_only", good[:33])]  # fmt: skip


def plan_request(i: int, rng: random.Random, cfg: SoakConfig, repeats: list[str]):
    """(label, body, expect, abort_after_chunks, abort_after_s) for request `i`."""
    kinds, weights = zip(*KINDS, strict=True)
    kind = rng.choices(kinds, weights)[0]
    stream = rng.random() < cfg.stream_fraction
    max_tokens = rng.randint(*cfg.max_tokens)
    text = prompt_text(rng)
    fresh = lambda j: data_url(png_bytes(10_000 * (cfg.seed + 1) + 10 * i + j, *rng.choice(SIZES)))
    abort_chunks = abort_s = None
    expect = "ok"
    if kind == "text":
        urls = []
    elif kind == "images":
        urls = [fresh(j) for j in range(rng.randint(1, 4))]
    elif kind == "repeat":
        urls, text = [rng.choice(repeats)], "what is in the picture"
    elif kind == "bad_image":
        label, data = rng.choice(cfg.bad_images)
        urls = [data_url(data)] + ([fresh(0)] if rng.random() < 0.5 else [])
        rng.shuffle(urls)
        expect, kind = "4xx", "bad_image"
    else:
        urls = [fresh(j) for j in range(rng.randint(0, 2))]
        max_tokens = rng.randint(16, 48)  # long enough to be cut mid-way
        expect = "abort"
        if stream:
            abort_chunks = rng.randint(1, 4)
        else:
            abort_s = rng.uniform(0.01, 0.3)
    label = f"{kind}{'/stream' if stream else ''}"
    return (
        label,
        chat_body(user_message(text, urls), max_tokens, stream),
        expect,
        abort_chunks,
        abort_s,
    )


async def drive(url: str, cfg: SoakConfig, num: int, seed: int, sampler=None) -> list[Outcome]:
    """`num` requests of the mix, `concurrency` in flight; bodies built on the fly."""
    from benchmarks.reliability.common import send

    repeats = [data_url(png_bytes(s, 64, 48)) for s in range(3)]
    outcomes: list[Outcome] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num):
        queue.put_nowait(i)

    async def worker(http) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            rng = random.Random(seed * 1_000_003 + i)  # the same plan whatever the timing
            label, body, expect, chunks, after_s = plan_request(i, rng, cfg, repeats)
            outcomes.append(await send(http, body, label, expect, chunks, after_s))
            if sampler is not None and len(outcomes) % 250 == 0:
                sampler(len(outcomes))

    async with client(url, timeout=120, max_connections=cfg.concurrency * 2) as http:
        await asyncio.gather(*(worker(http) for _ in range(cfg.concurrency)))
    return outcomes


def corpus_bad_images(num_bad: int = 100, seed: int = 1) -> list[tuple[str, bytes]]:
    """Bad images from the fuzz corpus (every category), as (kind, bytes)."""
    from benchmarks.reliability.corpus import generate_corpus

    with tempfile.TemporaryDirectory() as tmp:
        items = generate_corpus(Path(tmp), seed=seed, num_bad=num_bad)
        return [(i.kind, i.path.read_bytes()) for i in items if i.expect == "bad"]


def run_soak(cfg: SoakConfig, root=None, title: str = "soak") -> dict:
    if not cfg.bad_images:
        cfg.bad_images = corpus_bad_images()
    kw = {"root": root} if root is not None else {}
    with ServerProcess(*cfg.server_args, **kw) as server:
        asyncio.run(drive(server.url, cfg, cfg.num_warmup, cfg.seed + 1))
        warm = server.settled_vitals()
        rss_trace: list[tuple[int, int]] = [(0, warm.rss_kib)]
        sample = lambda n: rss_trace.append((n, server.vitals().rss_kib)) if server.alive else None
        start = time.perf_counter()
        outcomes = asyncio.run(drive(server.url, cfg, cfg.num_requests, cfg.seed, sample))
        wall_s = time.perf_counter() - start
        alive = server.alive
        end = server.settled_vitals() if alive else None
        integrity = server.integrity() if alive else {"ok": False, "error": "server died"}
        pid = server.pid
        exit_code = server.stop()
        log_tail = server.log_tail(2000)
    leftover_shm = shm_blocks(pid)
    counts = count(outcomes)
    rss_growth = (end.rss_kib - warm.rss_kib) / warm.rss_kib if end else None
    checks = {
        "server_alive": alive,
        "lost_requests": counts["lost"],
        "5xx": counts["5xx"],
        "unexpected_outcomes": counts["unexpected"],
        "leaked_kv_blocks": None if end is None else int(warm.free_blocks - end.free_blocks),
        "check_integrity_ok": bool(integrity.get("ok")),
        "rss_growth_fraction": rss_growth,
        "leftover_shm_blocks": len(leftover_shm),
    }
    passed = (alive and counts["lost"] == 0 and counts["5xx"] == 0 and counts["unexpected"] == 0
              and checks["leaked_kv_blocks"] == 0 and checks["check_integrity_ok"]
              and rss_growth is not None and rss_growth <= cfg.rss_tolerance
              and not leftover_shm)  # fmt: skip
    print_table(f"{title}: {cfg.num_requests} requests, {cfg.concurrency} in flight", outcomes)
    print(f"wall {wall_s:.0f} s ({cfg.num_requests / wall_s:.1f} req/s); KV free "
          f"{warm.free_blocks:.0f} -> {end.free_blocks if end else float('nan'):.0f} of "
          f"{warm.num_blocks:.0f}; integrity {integrity}; RSS {warm.rss_kib / 1024:.0f} -> "
          f"{(end.rss_kib if end else 0) / 1024:.0f} MiB ({(rss_growth or 0) * 100:+.1f}%); "
          f"shm left {len(leftover_shm)}; exit code {exit_code}")  # fmt: skip
    return {
        "passed": passed,
        "server_command": server.command.replace(cfg.model_label[0], cfg.model_label[1]),
        "config": {k: v for k, v in asdict(cfg).items() if k != "bad_images"}
        | {"num_bad_image_kinds": len(cfg.bad_images)},
        "counts": counts,
        "checks": checks,
        "wall_s": wall_s,
        "kv": {
            "num_blocks": warm.num_blocks,
            "free_after_warmup": warm.free_blocks,
            "free_at_end": end.free_blocks if end else None,
        },  # fmt: skip
        "rss_kib": {
            "after_warmup": warm.rss_kib,
            "at_end": end.rss_kib if end else None,
            "trace": rss_trace,
        },  # fmt: skip
        "integrity": integrity,
        "server_exit_code": exit_code,
        "server_log_tail": None if passed else log_tail,
    }

"""`vlmserve serve --replicas 2` on this machine (issue 40): 2 replicas of the embedded
model (one CPU each) on a local Ray cluster behind the front door, the recurring-image
trace (`search.sim.affinity_trace`) with the simulator's structure (the same shares of
pooled, own and text-only conversations, Zipf exponent, follow-up share and turns) scaled
to what 2 small replicas serve in a few minutes: the pool holds as many images per request
as the simulator's (300 per 3000 requests, so 12 for 120), which is what sets the hit
rates; prompts are sized to the embedded model's 512-token context. Sent over HTTP with
(a) pow2 (Ray Serve's default), (b) prefix (text-prefix affinity) and (c) cache_aware
(ours), each on freshly started replicas (cold caches), in interleaved rounds. Reported
per router (median over rounds): encoder-cache hit rate (the replicas' own counters),
prefix-cache hit rate (cached prompt tokens the usage reports), TTFT p50/p99 at the
client, output tokens/s, imbalance (max / mean requests a replica served, from its
labelled /metrics); then the issue's checks.

The replicas' encoder cache is the engine's default (`--encoder-cache-mb`, 256 MB): for the
embedded model's ~90 KB scenes it holds every image of the run, unlike a 7B replica's
(the simulator's holds about 58 of its images, fewer than the working set), so here the
routers differ only in how often an image is encoded on both replicas, never by eviction.
The front door is `vlmserve serve --replicas`'s (`front_door`): each image weighs the
visual tokens the engine gives it, and ours models each replica's encoder cache at the
size the replicas report (`routing_profile`, recorded in the result).

The router's parameters are the ones the simulator's tuning picked (on its own trace
seeds); this trace's seed (`--seed`, default 3) was used by no tuning. Two ceilings
are reported beside the routers: `compulsory` (every image's first sight a miss, every
later one a hit) and `oracle` (modelled: each image request sent to the replica whose
encoder-cache LRU of `images_per_cache` scenes holds it, ignoring load).

    python -m benchmarks.serving.replica_routing  # → benchmarks/results/replica_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import re
import statistics
import time
from dataclasses import replace

import httpx

from benchmarks.lib.common import table, write_result
from benchmarks.lib.lumpy_load import Measured, Planned, png, run_load
from benchmarks.reliability.common import data_url
from benchmarks.reliability.server import in_process_server
from benchmarks.serving.replica_routing_sim import (
    CHOSEN,
    HELD_OUT_SEEDS,
    MIN_REQUESTS,
    SHAPE,
    TUNING_SEEDS,
    checks,
)
from scheduler.routing.policy import ROUTERS, RouterConfig
from search.sim.affinity_trace import AffinityShape, affinity_trace, describe

WORDS = ("where is the red star and how many blue circles are on the left of a green "
         "square yellow triangle big small top bottom right word").split()  # fmt: skip
IMAGE_SIZE = (192, 144)  # InternVL 4x3 grid + thumbnail: 13 tiles, 117 tokens, ~90 KB pooled
SCENE_BYTES = 90e3  # one scene's pooled embeddings in the encoder cache


def shape(num_requests: int) -> AffinityShape:
    """The simulator's shape with its images per request (300 / 3000) and prompts sized to
    the embedded model's 512-token context."""
    images = max(1, round(SHAPE.num_images * num_requests / MIN_REQUESTS))
    return replace(SHAPE, num_images=images, system_tokens=(30, 60), question_tokens=(4, 10),
                   max_tokens=(8, 24))  # fmt: skip


def images_per_cache(encoder_cache_mb: int) -> int:
    return int(encoder_cache_mb * 2**20 // SCENE_BYTES)


def png_seed(key: str) -> int:
    """A distinct picture per content key: pool images `img<k>`, own images `own<i>`."""
    return 7000 + int(key.removeprefix("img")) if key.startswith("img") else 10**6 + int(key[3:])


def plan(num_requests: int, rate: float, seed: int) -> list[Planned]:
    """The trace as HTTP bodies: a conversation's turns repeat its earlier messages (the
    same system prompt, image, questions and stand-in answers), so each turn's prompt
    starts with the one before; `user` names the conversation."""
    form = shape(num_requests)
    trace = affinity_trace(num_requests, rate, form, seed=seed)
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*form.system_tokens)))
               for _ in range(form.num_system_prompts)]  # fmt: skip
    images: dict[str, str] = {}
    turns: dict[str, list[dict]] = {}
    out = []
    for req in trace:
        history = turns.setdefault(req.session_id, [])
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*form.question_tokens)))
        content: list[dict] = [{"type": "text", "text": question}]
        if not history and req.images:
            key = req.images[0].content_hash
            url = images.setdefault(key, data_url(png(*IMAGE_SIZE, png_seed(key))))
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        history.append({"role": "user", "content": content})
        messages = [{"role": "system", "content": systems[req.system_prompt_id - 1]}, *history]
        body = {
            "messages": messages, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "user": req.session_id,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        images_of = tuple(im.content_hash for im in req.images)
        out.append(Planned(req.request_id, req.arrival_s, req.request_class, body, (), images_of))
        answer = " ".join(rng.choice(WORDS) for _ in range(req.max_tokens // 2))
        history.append({"role": "assistant", "content": answer})
    return out


def uploads(planned: list[Planned]) -> list[bytes]:
    """Every distinct image the trace sends, as bytes."""
    urls = {item["image_url"]["url"] for p in planned for m in p.body["messages"]
            if isinstance(m["content"], list) for item in m["content"]
            if item["type"] == "image_url"}  # fmt: skip
    return [base64.b64decode(url.split(",", 1)[1]) for url in sorted(urls)]


def ceilings(planned: list[Planned], per_cache: int, num_replicas: int = 2) -> dict[str, float]:
    """Hit rates no router beats: `compulsory` (infinite caches) and `oracle` (each image
    request sent where an LRU of `per_cache` scenes holds it, else to the replica with the
    fewest requests so far)."""
    seen: set[str] = set()
    caches: list[list[str]] = [[] for _ in range(num_replicas)]
    served = [0] * num_replicas
    lookups = compulsory = oracle = 0
    for p in planned:
        for key in p.images:
            lookups, compulsory = lookups + 1, compulsory + (key in seen)
            seen.add(key)
        holders = [i for i, c in enumerate(caches) if p.images and p.images[0] in c]
        i = holders[0] if holders else min(range(num_replicas), key=served.__getitem__)
        served[i] += 1
        for key in p.images:
            oracle += key in caches[i]
            if key in caches[i]:
                caches[i].remove(key)
            caches[i] = [*caches[i], key][-per_cache:]
    return {"compulsory": compulsory / max(1, lookups), "oracle": oracle / max(1, lookups)}


def scrape(url: str) -> dict[str, float]:
    """{series with labels: value} of the front door's /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(name + "{") or k == name)


def per_replica(metrics: dict[str, float], name: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for k, v in metrics.items():
        match = re.match(rf'{name}{{replica="([^"]+)"', k)
        if match:
            counts[match[1]] = counts.get(match[1], 0.0) + v
    return counts


def one_run(router: str, planned: list[Planned], args: argparse.Namespace, run: int) -> dict:
    from vlmserve.cli import serve as serve_cli
    from vlmserve.cli.engine_args import engine_config_from_args
    from vlmserve.cli.serve_replicas import front_door
    from vlmserve.replicas import launch
    from vlmserve.server.app import ServerConfig

    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    flags = ["serve", "--preprocess-workers", "0", "--encoder-cache-mb", str(args.encoder_cache_mb)]
    engine = engine_config_from_args(parser.parse_args(flags))
    # Its own deployment name: Ray Serve keeps a request router per name in a process.
    name = f"vlmserve-{router}-{run}"
    config = launch.ReplicaConfig(num_replicas=2, router=router, seed=args.seed,
                                  load_factor=CHOSEN["load_factor"],
                                  deployment_name=name)  # fmt: skip
    server = ServerConfig(model_name="m")
    handle = launch.start_replicas(engine, server, config)
    front = front_door(handle, server, name)  # as `vlmserve serve --replicas` has it
    try:
        with in_process_server(front) as url:
            started = time.perf_counter()
            measured: list[Measured] = asyncio.run(run_load(url, planned))
            wall = time.perf_counter() - started
            metrics = scrape(url)
            reasons = launch.router_decisions(name)
            profile = launch.routing_profile(name)
            priced = [profile.image_tokens(data) for data in uploads(planned)]
    finally:
        launch.stop(shutdown_ray=False)
    lookups = sum(len(p.images) for p in planned)  # each request sends its images again
    reported = {"encoder_cache_tokens": profile.encoder_cache_tokens,
                "image_tokens": sorted(set(priced))}  # fmt: skip
    return summarize(router, measured, metrics, wall, lookups) | {
        "reasons": reasons, "replica_profile": reported}  # fmt: skip


def summarize(
    router: str, measured: list[Measured], metrics: dict, wall: float, lookups: int
) -> dict:
    """The encoder-cache hit rate as the simulator counts it: images found in the chosen
    replica's encoder cache (the engine's hit counter, counted when a request's images are
    prepared) over the images the requests carried; the engine's own misses count only
    images the tower ran (an image inside a prefix-cache hit needs neither)."""
    ok = [m for m in measured if m.error is None and m.ttft_s is not None]
    ttfts = sorted(m.ttft_s for m in ok)
    hits = total(metrics, "vlmserve_encoder_cache_hits_total")
    misses = total(metrics, "vlmserve_encoder_cache_misses_total")
    served = per_replica(metrics, "vlmserve_requests_total")
    mean = sum(served.values()) / max(1, len(served))
    return {
        "router": router,
        "num_ok": len(ok),
        "num_errors": len(measured) - len(ok),
        "encoder_cache_hit_rate": hits / max(1, lookups),
        "encoder_cache_hits": hits,
        "images_sent": lookups,
        "images_encoded": misses,  # tower runs
        "prefix_cache_hit_rate": sum(m.cached_tokens for m in ok)
        / max(1, sum(m.prompt_tokens for m in ok)),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": statistics.quantiles(ttfts, n=100, method="inclusive")[98],
        "throughput_tok_s": sum(m.completion_tokens for m in ok) / wall,
        "imbalance": max(served.values()) / mean if mean else float("nan"),
        "requests_per_replica": sorted(served.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=2.0, help="arrivals/s over both replicas")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--encoder-cache-mb", type=int, default=256, help="the engine's default")
    p.add_argument("--seed", type=int, default=HELD_OUT_SEEDS[0])
    args = p.parse_args()
    defaults = RouterConfig()  # what the replicas' router gets besides the load factor
    assert all(getattr(defaults, k) == v for k, v in CHOSEN.items()), (defaults, CHOSEN)
    import ray

    from vlmserve.replicas.launch import stop

    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": env})  # fmt: skip
    planned = plan(args.requests, args.rate, args.seed)
    runs: dict[str, list[dict]] = {r: [] for r in ROUTERS}
    try:
        for k in range(args.rounds):
            order = ROUTERS if k % 2 == 0 else tuple(reversed(ROUTERS))
            for router in order:
                runs[router].append(one_run(router, planned, args, k))
                print(runs[router][-1], f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        stop()
    medians = {r: _median(v) for r, v in runs.items()}
    print(table(list(medians.values()), ["router", "encoder_cache_hit_rate",
          "prefix_cache_hit_rate", "images_encoded", "ttft_p50_s", "ttft_p99_s",
          "throughput_tok_s", "imbalance", "num_errors"]))  # fmt: skip
    verdict = checks(medians)
    ceiling = ceilings(planned, images_per_cache(args.encoder_cache_mb))
    ratios = {k: medians["cache_aware"]["encoder_cache_hit_rate"] / v
              for k, v in {"pow2": medians["pow2"]["encoder_cache_hit_rate"]}.items()}  # fmt: skip
    ratios |= {f"{k}_over_pow2": v / medians["pow2"]["encoder_cache_hit_rate"]
               for k, v in ceiling.items()}  # fmt: skip
    print("ceilings:", ceiling, "ratios:", ratios)
    print("checks:", verdict)
    path = write_result("replica_routing", {
        "model": "embedded default, 2 replicas x 1 CPU, local Ray cluster",
        "trace": {"shape": shape(args.requests).__dict__, "requests": args.requests,
                  "rate": args.rate, "seed": args.seed, "image_size": IMAGE_SIZE,
                  "held": describe(affinity_trace(args.requests, args.rate,
                                                  shape(args.requests), seed=args.seed)),
                  "images_per_cache": images_per_cache(args.encoder_cache_mb)},
        "seed": {"trace": args.seed, "held_out": args.seed not in TUNING_SEEDS,
                 "tuning_seeds_of_the_params": TUNING_SEEDS},
        "cache_aware_params": CHOSEN,
        "encoder_cache_mb": args.encoder_cache_mb,
        "ceilings": ceiling, "hit_ratios": ratios,
        "rounds": runs, "medians": medians, "checks": verdict,
    })  # fmt: skip
    print(f"wrote {path}")


def _median(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in rows)
    return out


if __name__ == "__main__":
    main()

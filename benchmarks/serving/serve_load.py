"""Load test of `/v1/chat/completions`: Poisson arrivals of a request mix, streamed.

    .venv/bin/python -m benchmarks.serving.serve_load              # in-process server, tiny model
    .venv/bin/python -m benchmarks.serving.serve_load --model CKPT --num-requests 300 --rate 4
    .venv/bin/python -m benchmarks.serving.serve_load --url http://127.0.0.1:8000 --api-key KEY

The mix: text-only, one image, several images, and a repeated image (drawn from a pool
of three, so later asks hit the prefix cache). Reports request throughput, TTFT and TPOT
p50/p90/p99 per kind and overall, and goodput: requests per second that met both the
TTFT and the TPOT target. Writes JSON to benchmarks/results/serve_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import random
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from benchmarks.lib.common import write_json

KINDS = (("text", 0.4), ("one_image", 0.3), ("multi_image", 0.15), ("repeated_image", 0.15))
WORDS = "where is the red star and how many blue circles are on the left".split()


@dataclass
class Result:
    kind: str
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float = 0.0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    num_prompt_tokens: int | None = None  # as the server counted them (its usage)


def image_url(seed: int, rng: random.Random) -> str:
    width, height = rng.choice([(64, 48), (96, 64), (48, 96), (128, 96)])
    pixels = np.random.default_rng(seed).integers(1, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_messages(kind: str, index: int, rng: random.Random, pool: list[str]) -> list[dict]:
    text = " ".join(rng.choices(WORDS, k=rng.randint(4, 12)))
    urls = {
        "text": [],
        "one_image": [image_url(1000 + index, rng)],
        "multi_image": [image_url(2000 + 10 * index + j, rng) for j in range(rng.randint(2, 3))],
        "repeated_image": [rng.choice(pool)],
    }[kind]
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


async def one_request(
    client: httpx.AsyncClient, kind: str, messages: list[dict] | list[int], max_tokens: int
) -> Result:
    """One streamed greedy request: a chat, or (`messages` a list of token ids) a
    completion of those ids, as `vllm bench serve` sends a tokenized dataset."""
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    ids = bool(messages) and isinstance(messages[0], int)
    body["prompt" if ids else "messages"] = messages
    path = "/v1/completions" if ids else "/v1/chat/completions"
    start = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                error = json.loads(await response.aread())["error"]["message"]
                return Result(kind, False, e2e_s=time.perf_counter() - start, error=error)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(kind, False, error=chunk["error"]["message"])
                choice = chunk["choices"][0] if chunk["choices"] else {}
                if choice.get("text") if ids else (choice.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as e:
        return Result(kind, False, e2e_s=time.perf_counter() - start, error=repr(e))
    end = time.perf_counter()
    n = usage.get("completion_tokens", len(times))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    ttft = times[0] - start if times else None
    tpot = (end - times[0]) / (n - 1) if times and n > 1 else None
    return Result(kind, True, ttft, tpot, end - start, n, cached,
                  num_prompt_tokens=usage.get("prompt_tokens"))  # fmt: skip


async def run_load(base_url: str, args: argparse.Namespace) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    pool = [image_url(seed, rng) for seed in range(3)]
    kinds, weights = zip(*KINDS, strict=True)
    plan = [rng.choices(kinds, weights)[0] for _ in range(args.num_requests)]
    payloads = [make_messages(kind, i, rng, pool) for i, kind in enumerate(plan)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.num_requests)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        tasks = []
        start = time.perf_counter()
        for kind, messages in zip(plan, payloads, strict=True):
            tasks.append(asyncio.create_task(one_request(client, kind, messages, args.max_tokens)))
            await asyncio.sleep(rng.expovariate(args.rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def summarise(results: list[Result], wall_s: float, args: argparse.Namespace) -> dict:
    def block(rs: list[Result]) -> dict:
        ok = [r for r in rs if r.ok]
        good = [
            r for r in ok if (r.ttft_s or 0) <= args.ttft_slo and (r.tpot_s or 0) <= args.tpot_slo
        ]
        return {
            "requests": len(rs), "ok": len(ok), "errors": len(rs) - len(ok),
            "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
            "e2e_s": percentiles([r.e2e_s for r in ok]),
            "goodput_rps": len(good) / wall_s,
            "cached_tokens": sum(r.num_cached_tokens for r in ok),
        }  # fmt: skip

    ok = [r for r in results if r.ok]
    return {
        "wall_s": wall_s,
        "throughput_rps": len(ok) / wall_s,
        "output_tokens_per_s": sum(r.num_output_tokens for r in ok) / wall_s,
        "targets": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "all": block(results),
        "by_kind": {k: block([r for r in results if r.kind == k]) for k, _ in KINDS},
        "errors": sorted({r.error for r in results if r.error})[:10],
    }


def render(summary: dict) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f}"
    head = f"{'kind':<16}{'n':>5}{'err':>5}" + "".join(
        f"{m + ' ' + p:>11}" for m in ("TTFT", "TPOT") for p in ("p50", "p90", "p99")
    ) + f"{'goodput/s':>11}"  # fmt: skip
    rows = [head + "   (times in ms)"]
    for name, b in [("all", summary["all"]), *summary["by_kind"].items()]:
        cells = [ms(b[m][p]) for m in ("ttft_s", "tpot_s") for p in ("p50", "p90", "p99")]
        row = f"{name:<16}{b['requests']:>5}{b['errors']:>5}" + "".join(f"{c:>11}" for c in cells)
        rows.append(row + f"{b['goodput_rps']:>11.2f}")
    rows.append(
        f"throughput {summary['throughput_rps']:.2f} req/s, "
        f"{summary['output_tokens_per_s']:.1f} output tokens/s over {summary['wall_s']:.1f} s; "
        f"goodput = requests/s with TTFT <= {summary['targets']['ttft_s']} s and "
        f"TPOT <= {summary['targets']['tpot_s']} s"
    )
    return "\n".join(rows)


@contextlib.contextmanager
def local_server(model: str | None):
    """An in-process server on a free loopback port (a tiny random model by default)."""
    import uvicorn

    from scheduler.config import CacheConfig, SchedulerConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine
    from vlmserve.server.app import ServerConfig, create_app

    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

            model = str(make_vlm_checkpoint(Path(tmp) / "tiny", "llava_onevision"))
        config = EngineConfig(
            ModelConfig(model), CacheConfig(), SchedulerConfig(max_num_batched_tokens=1024)
        )
        app = create_app(lambda: Engine(config), ServerConfig(model_name="bench"))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.1)
        try:
            yield url
        finally:
            server.should_exit = True
            thread.join(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one here)")
    p.add_argument("--model", default=None, help="checkpoint for the in-process server")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT target, seconds")
    p.add_argument("--tpot-slo", type=float, default=0.2, help="TPOT target, seconds")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output", default=str(Path(__file__).resolve().parents[1] / "results" / "serve_load.json")
    )
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server(args.model))
        results, wall_s = asyncio.run(run_load(url, args))
    summary = summarise(results, wall_s, args)
    print(render(summary))
    out = Path(args.output)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    write_json(out, {"config": config, "summary": summary,
                     "results": [asdict(r) for r in results]})  # fmt: skip
    print(f"wrote {out}")
    return 0 if summary["all"]["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

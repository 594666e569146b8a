"""The serving part of `benchmarks/serving/vs_vllm.py` (--serve): `vllm serve` and `vlmserve serve`
on the same checkpoint under the same Poisson load from one streaming client
(`benchmarks/serving/serve_load.py`'s request loop), with the same KV block size and cache budget.
Both servers are up for the whole sweep and the load alternates between them pass by pass:
each rate is offered `repeats` times to each server, in the order ABBA... that
`pass_order` gives (it flips from rate to rate as well), each pass with its own prompts
(the same for both servers), so a slow minute of a shared host falls on both and not on
one server's whole sweep. The idle server's CPU time while the other is loaded is
recorded (`idle_cpu_s`): it should be near zero; each pass starts once both servers are
idle (`settle`), so one server's leftover work never falls on the other's pass. Offered
rates rise until vLLM saturates; vlmserve gets the same rates (until it saturates too).
Reported per rate: the medians over the passes of TTFT p99, TPOT p50 and completed
requests/s (`median_point`); each pass is kept under `passes`.

Saturated at a rate: raising the offered rate to it from the previous one raised the
completed requests per second by less than half the increase (the rest only queued), or
a request failed. A single run cannot say (its completions include the queue's drain).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

import vlmserve
from benchmarks.lib import vllm_cpu
from benchmarks.lib.server_process import free_port, server_process
from benchmarks.lib.vs_vllm_workloads import kv_bytes_per_token, synthetic_jpeg
from benchmarks.serving.serve_load import one_request, percentiles
from vlmserve.worker.models.random_checkpoint import WORDS

REPO = Path(__file__).resolve().parents[2]
VLLM_SERVE = Path(__file__).resolve().parent / "vllm_serve.py"
# vLLM's CPU attention takes multiples of 32 only ("ValueError: No common block size for
# 16 (CPU_ATTN: [MultipleOf(32)])"; its default is 128): both serve with 32.
BLOCK_SIZE = 32
SYSTEMS = ("vllm", "vlmserve")
SERVED_SHARE = 0.5
STARTUP_TIMEOUT_S = 1200.0


def chat_payloads(requests: list[dict], variant: int = 0) -> list[tuple[list[dict], int]]:
    """(messages, max_tokens) per request: the text workload's prompt lengths as words (one
    token each with the word-level tokenizer), or the image workload's JPEG and question.
    Each `variant` has other words and other pictures (written beside the originals), so
    no rate of a sweep hits the prefix or encoder cache that an earlier one filled."""
    rng = random.Random(variant)
    payloads = []
    for i, r in enumerate(requests):
        if "prompt_token_ids" in r:
            text = " ".join(rng.choices(WORDS[:40], k=len(r["prompt_token_ids"])))
            messages = [{"role": "user", "content": text}]
        else:
            path = Path(r["image"])
            if variant:
                path = path.with_name(f"{path.stem}_v{variant}.jpg")
                if not path.is_file():
                    synthetic_jpeg(path, seed=1_000_000 * variant + i)
            data = base64.b64encode(path.read_bytes()).decode()
            url = {"url": f"data:image/jpeg;base64,{data}"}
            content = [
                {"type": "image_url", "image_url": url},
                {"type": "text", "text": r["question"]},
            ]
            messages = [{"role": "user", "content": content}]
        payloads.append((messages, r["max_tokens"]))
    return payloads


def real_payloads(requests: list[dict], variant: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request of the real workload, sent as completions
    of token ids (both servers then see the same tokens, with no chat template between).
    Variant 0 is the spec's prompts; each other one takes other slices of the same prose
    at the same lengths (BOS first), so no pass hits a prefix an earlier one cached."""
    if not variant:
        return [(r["prompt_token_ids"], r["max_tokens"]) for r in requests]
    corpus = _real_corpus()
    rng = random.Random(variant)
    payloads = []
    for r in requests:
        ids = r["prompt_token_ids"]
        start = rng.randrange(len(corpus) - len(ids))
        payloads.append(([ids[0], *corpus[start : start + len(ids) - 1]], r["max_tokens"]))
    return payloads


@functools.cache
def _real_corpus() -> list[int]:
    from transformers import AutoTokenizer

    from benchmarks.lib.real_model import fetch_hf_dir
    from benchmarks.lib.vs_vllm_workloads import real_corpus_ids

    return real_corpus_ids(AutoTokenizer.from_pretrained(str(fetch_hf_dir())))


def payloads_of(spec: dict, requests: list[dict], variant: int) -> list:
    """What each request of `spec`'s workload sends: token ids (real) or chat messages."""
    if spec["workload"] == "real":
        return real_payloads(requests, variant)
    return chat_payloads(requests, variant)


def is_saturated(previous: dict | None, point: dict) -> bool:
    """Whether `point` (rate, completed_per_s, failed) is past the knee (see module doc)."""
    if point["failed"]:
        return True
    if previous is None:
        return False
    added = point["rate"] - previous["rate"]
    return point["completed_per_s"] - previous["completed_per_s"] < SERVED_SHARE * added


def server_command(system: str, spec: dict, args: argparse.Namespace, port: int) -> list[str]:
    engine = spec["engine"]
    common = ["--host", "127.0.0.1", "--port", str(port),
              "--dtype", engine.get("dtype", "float32"),
              "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(engine["max_num_seqs"]),
              "--max-num-batched-tokens", str(engine["max_num_batched_tokens"]),
              "--max-model-len", str(engine["max_model_len"])]  # fmt: skip
    if system == "vllm":
        cmd = [str(args.vllm_python), str(VLLM_SERVE), "serve", spec["model"], *common,
               "--seed", "0", "--served-model-name", "bench"]  # fmt: skip
        if spec["workload"] == "image":
            cmd += ["--limit-mm-per-prompt", '{"image": 1, "video": 0}',
                    "--mm-processor-kwargs", '{"use_fast": false}']  # fmt: skip
        return cmd
    # The same KV bytes as vLLM's VLLM_CPU_KVCACHE_SPACE: in vlmserve's blocks, or as a
    # budget where Gemma 3's sliding-window layers keep blocks of their own (real).
    if spec["workload"] == "real":
        kv = ["--kv-cache-mb", str(engine["kv_cache_gib"] * 1024)]
    else:
        bytes_per_block = BLOCK_SIZE * spec["kv_bytes_per_token"]
        kv = ["--num-kv-blocks", str(engine["kv_cache_gib"] * 2**30 // bytes_per_block)]
    drafts = args.speculative_tokens  # None: the engine's default
    spec_flags = [] if drafts is None else ["--speculative-tokens", str(drafts)]
    return [sys.executable, "-m", "vlmserve.cli", "serve", "--model", spec["model"], *common,
            *kv, *spec_flags, "--served-model-name", "bench"]  # fmt: skip


@contextlib.contextmanager
def running_server(
    system: str, spec: dict, args: argparse.Namespace, log: Path
) -> Iterator[tuple[str, int]]:
    """A server on a free loopback port, ready (GET /health is 200), as (url, pid); stopped
    on exit."""
    port = free_port()
    # Not this process's OpenMP policy (vlmserve/__init__.py set it for a library user):
    # each server picks its own, as it does when its users start it.
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    if system == "vllm":
        env.update(vllm_cpu.tuned_env(args.vllm_venv, spec["engine"]["kv_cache_gib"]))
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(system, spec, args, port)
    with server_process(cmd, env, REPO, log, url, f"{system} server", STARTUP_TIMEOUT_S, 2) as pid:
        yield url, pid


async def _load(url: str, payloads: list, rate: float, seed: int) -> tuple[list, float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(payloads))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        tasks, start = [], time.perf_counter()
        for messages, max_tokens in payloads:
            tasks.append(asyncio.create_task(one_request(client, "chat", messages, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def measure_rate(url: str, payloads: list, rate: float) -> dict:
    results, wall_s = asyncio.run(_load(url, payloads, rate, seed=0))
    ok = [r for r in results if r.ok]
    completed_per_s = len(ok) / wall_s
    return {
        "rate": rate,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "completed_per_s": completed_per_s,
        "output_tok_per_s": sum(r.num_output_tokens for r in ok) / wall_s,
        # as the server counted them: both servers must see the same prompts
        "prompt_tokens": sum(r.num_prompt_tokens or 0 for r in ok),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its children (the engine processes): the
    session it leads (each server starts its own), read from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == pid:  # field 6: the session id
                total += int(fields[11]) + int(fields[12])
    return total / tick


def settle(pids: list[int], quiet: float = 0.05, timeout_s: float = 60.0) -> float:
    """Wait until every server is idle (under `quiet` CPU seconds a second over one
    second) before a pass starts, and return the seconds waited: a server still busy
    after its own pass (vLLM's engine keeps working for a few seconds after its last
    response) would otherwise tax the pass that follows it, always the other server's."""
    start = time.monotonic()
    before = [process_cpu_s(p) for p in pids]
    while time.monotonic() - start < timeout_s:
        time.sleep(1.0)
        after = [process_cpu_s(p) for p in pids]
        if all(b - a < quiet for a, b in zip(before, after, strict=True)):
            break
        before = after
    return round(time.monotonic() - start, 1)


def summary(points: list[dict]) -> dict:
    sustained = [p["rate"] for p in points if not p["saturated"]]
    saturated = [p["rate"] for p in points if p["saturated"]]
    return {
        "points": points,
        "max_sustained_rate": max(sustained) if sustained else None,
        "saturation_rate": min(saturated) if saturated else None,
    }


def pass_order(rate_index: int, repeats: int) -> list[tuple[int, str]]:
    """(pass, system) for one rate: each pass loads both servers, and the one loaded
    first alternates from pass to pass and from rate to rate (vLLM first at the first)."""
    order = []
    for j in range(repeats):
        first = (rate_index * repeats + j) % 2
        order += [(j, SYSTEMS[first]), (j, SYSTEMS[1 - first])]
    return order


def median_point(passes: list[dict]) -> dict:
    """One rate's point from its passes: medians of completed req/s, output tok/s and each
    latency percentile, failures summed (a failed request in any pass counts), and the
    most CPU the idle server used during any of them."""

    def med(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def quantiles(key: str) -> dict:
        return {q: med([p[key][q] for p in passes]) for q in ("p50", "p90", "p99")}

    return {
        "rate": passes[0]["rate"],
        "requests": sum(p["requests"] for p in passes),
        "failed": sum(p["failed"] for p in passes),
        "errors": sorted({e for p in passes for e in p["errors"]})[:5],
        "completed_per_s": med([p["completed_per_s"] for p in passes]),
        "output_tok_per_s": med([p["output_tok_per_s"] for p in passes]),
        "ttft_s": quantiles("ttft_s"),
        "tpot_s": quantiles("tpot_s"),
        "idle_cpu_s": max(p["idle_cpu_s"] for p in passes),
        "passes": passes,
    }


def interleaved_sweeps(
    spec: dict, args: argparse.Namespace, rates: list[float], repeats: int
) -> dict:
    """Both servers up; at each rising rate each server not yet saturated takes the load
    `repeats` times, alternating with the other (`pass_order`), until vLLM saturates."""
    points: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    with contextlib.ExitStack() as stack:
        try:
            servers = {s: stack.enter_context(running_server(s, spec, args,
                       Path(spec["path"]).parent / f"serve_{s}.log")) for s in SYSTEMS}  # fmt: skip
        except RuntimeError as e:
            return {s: {"error": str(e), "points": []} for s in SYSTEMS}
        for s in SYSTEMS:
            asyncio.run(_load(servers[s][0], payloads_of(spec, spec["warmup"], 0), 1.0, seed=1))
        for k, rate in enumerate(rates):
            live = [s for s in SYSTEMS if not (points[s] and points[s][-1]["saturated"])]
            passes: dict[str, list[dict]] = {s: [] for s in live}
            # Each pass's prompts (and pictures), the same for both servers.
            payloads = [payloads_of(spec, spec["requests"], 1 + k * repeats + j)
                        for j in range(repeats)]  # fmt: skip
            for j, s in pass_order(k, repeats):
                if s not in live:
                    continue
                idle_pid = servers[_other(s)][1]
                settled_s = settle([servers[x][1] for x in SYSTEMS])
                idle_before = process_cpu_s(idle_pid)
                one = measure_rate(servers[s][0], payloads[j], rate)
                one["idle_cpu_s"] = round(process_cpu_s(idle_pid) - idle_before, 2)
                one["settled_s"] = settled_s
                print(f"  serve {s} rate {rate:g}/s pass {j + 1}/{repeats}: "
                      f"{one['completed_per_s']:.3f} req/s, TTFT p99 {one['ttft_s']['p99']}, "
                      f"TPOT p50 {one['tpot_s']['p50']}, the idle server used "
                      f"{one['idle_cpu_s']} CPU s", flush=True)  # fmt: skip
                passes[s].append(one)
            for s in live:
                point = median_point(passes[s])
                point["saturated"] = is_saturated(points[s][-1] if points[s] else None, point)
                print(f"  serve {s} rate {rate:g}/s, medians: {point['completed_per_s']:.3f} "
                      f"req/s, TTFT p99 {point['ttft_s']['p99']}, TPOT p50 "
                      f"{point['tpot_s']['p50']}"
                      f"{' (saturated)' if point['saturated'] else ''}", flush=True)  # fmt: skip
                points[s].append(point)
            if points["vllm"][-1]["saturated"]:
                break
    return {s: summary(points[s]) for s in SYSTEMS}


def _other(system: str) -> str:
    return SYSTEMS[1 - SYSTEMS.index(system)]


def run_serving(spec: dict, args: argparse.Namespace, rates: list[float]) -> dict:
    if spec["workload"] != "real":  # the real checkpoint's KV is given as bytes
        spec = {**spec, "kv_bytes_per_token": kv_bytes_per_token(args.text_args)}
    print(f"[vs_vllm] serve {spec['workload']}: rates {rates}", flush=True)
    sweeps = interleaved_sweeps(spec, args, rates, args.serve_repeats)
    return {
        "rates": [p["rate"] for p in sweeps["vllm"]["points"]] or rates,
        "interleaved": True,
        "repeats": args.serve_repeats,
        "block_size": BLOCK_SIZE,
        "kv_cache_gib": spec["engine"]["kv_cache_gib"],
        **sweeps,
    }

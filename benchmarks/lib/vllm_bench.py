"""Cold vs warm on a real checkpoint with vLLM's own load generator (issue 41): for each
server (vLLM's CPU build and vlmserve, the same flags), a fresh start, then
`vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
--random-input-len 400 --random-output-len 128 --ignore-eos` sent twice right after
/health turns 200: the first 40 requests (of which the first 8) against the next 40, at the
same rate. Per-request TTFT and TPOT come from its detailed result file.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import vlmserve
from benchmarks.lib import vllm_cpu
from benchmarks.lib.server_process import free_port, server_process
from benchmarks.serving.serve_load import percentiles

REPO = Path(__file__).resolve().parents[2]
VLLM_SERVE = REPO / "benchmarks" / "lib" / "vllm_serve.py"
SYSTEMS = ("vllm", "vlmserve")
STARTUP_TIMEOUT_S = 1200.0
KV_CACHE_GIB = 4


def server_command(system: str, model: str, port: int, python: str) -> list[str]:
    """The issue's flags for both servers (KV cache: 4 GiB each); `python` runs it."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
              "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
              "--max-model-len", "4096", "--served-model-name", "bench"]  # fmt: skip
    if system == "vllm":
        return [python, str(VLLM_SERVE), "serve", model, *common, "--seed", "0"]
    return [python, "-m", "vlmserve.cli", "serve", "--model", model, *common,
            "--kv-cache-mb", str(KV_CACHE_GIB * 1024)]  # fmt: skip


@contextlib.contextmanager
def fresh_server(system: str, model: str, venv: Path, log: Path) -> Iterator[tuple[str, float]]:
    """A fresh server, healthy: (url, seconds from launch to /health 200)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
    python = sys.executable
    if system == "vllm":  # (the project's `kernels` must not pass for vLLM's hub package)
        env.pop("PYTHONPATH")
        env.update(vllm_cpu.tuned_env(venv, KV_CACHE_GIB))
        python = str(vllm_cpu.venv_python(venv))
    cmd = server_command(system, model, port, python)
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    with server_process(cmd, env, REPO, log, url, f"{system} server", STARTUP_TIMEOUT_S, 0.5):
        yield url, time.perf_counter() - start


def bench_serve(  # noqa: PLR0913
    venv: Path, url: str, model: str, num_prompts: int, rate: float, seed: int, out: Path
) -> list[dict]:
    """`vllm bench serve` against `url`: per request in send order, its TTFT, TPOT (s),
    output tokens and error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(vllm_cpu.venv_python(venv)), str(VLLM_SERVE), "bench", "serve",
           "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", model, "--served-model-name", "bench",
           "--dataset-name", "random", "--random-input-len", "400",
           "--random-output-len", "128", "--ignore-eos",
           "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(seed),
           "--save-result", "--save-detailed", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--disable-tqdm"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    env.pop("PYTHONPATH", None)
    with (out.parent / f"{out.stem}.log").open("w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    result = json.loads(out.read_text())
    rows = []
    for i in sorted(range(len(result["ttfts"])), key=lambda i: result["start_times"][i]):
        ttft, latency, tokens = (result[k][i] for k in ("ttfts", "latencies", "output_lens"))
        ok = not result["errors"][i] and tokens > 0
        rows.append({
            "ttft_s": ttft if ok else None,
            "tpot_s": (latency - ttft) / (tokens - 1) if ok and tokens > 1 else None,
            "output_tokens": tokens, "error": result["errors"][i] or None,
        })  # fmt: skip
    return rows


def block(rows: list[dict]) -> dict:
    """TTFT and TPOT percentiles (ms) of some requests, and how many failed."""
    ttft = [r["ttft_s"] * 1e3 for r in rows if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] * 1e3 for r in rows if r["tpot_s"] is not None]
    return {"n": len(rows), "failed": sum(r["error"] is not None for r in rows),
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot)}  # fmt: skip


def one_system(  # noqa: PLR0913
    system: str, model: str, venv: Path, rate: float, seed: int, root: Path, num: int = 40
) -> dict:
    """A fresh server, the first `num` requests after /health, then the next `num`; its
    start-up log's warm-up line (vlmserve)."""
    log = root / f"{system}_{seed}.log"
    with fresh_server(system, model, venv, log) as (url, healthy_s):
        first = bench_serve(venv, url, model, num, rate, seed, root / f"{system}_{seed}_a.json")
        nxt = bench_serve(venv, url, model, num, rate, seed + 1, root / f"{system}_{seed}_b.json")
    warmup = [line for line in log.read_text(errors="replace").splitlines() if "warm-up" in line]
    return {"system": system, "seed": seed, "rate": rate, "healthy_after_s": healthy_s,
            "num": num, "warmup_log": warmup[-1:], "first_8": block(first[:8]),
            "first_40": block(first), "next_40": block(nxt),
            "requests": {"first": first, "next": nxt}}  # fmt: skip

"""The first minute of a fresh server (issue 41): one streamed completion right after
/health turns 200, then six at once (one with logprobs), then the same once warm; the
seconds to each first token. `--tree` serves another checkout's code (e.g. an export of
main) with the same requests, for a before/after on one machine.

    .venv/bin/python -m benchmarks.serving.first_minute --model ~/.cache/vlmserve/real/gemma-3-270m
Writes benchmarks/results/first_minute.json (the command, the CPU, the load).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from benchmarks.lib.common import environment, write_result
from benchmarks.lib.server_process import free_port, server_process

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The history of the printing press begins in the fifteenth century, when " * 6


def first_token_s(url: str, i: int, **extra) -> float:
    body = {"model": "bench", "prompt": f"{i} {PROMPT}", "max_tokens": 4, "stream": True,
            **extra}  # fmt: skip
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return round(time.perf_counter() - start, 3)
    raise RuntimeError("a stream without a token")


def six(url: str, base: int) -> list[float]:
    with ThreadPoolExecutor(6) as pool:
        extras = [{"logprobs": 2}] + [{}] * 5
        return list(pool.map(lambda i, e: first_token_s(url, base + i, **e), range(6), extras))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tree", type=Path, default=REPO, help="the checkout whose code serves")
    p.add_argument("--log", type=Path, default=Path("first_minute_server.log"))
    p.add_argument("--name", default="first_minute")
    args = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vlmserve.cli", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
           "--max-model-len", "4096", "--kv-cache-mb", "4096",
           "--served-model-name", "bench"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.environ.get("PYTHONPATH"), str(args.tree)]))}  # fmt: skip
    start = time.perf_counter()
    with server_process(cmd, env, args.tree, args.log, url, "server", 1200, 0.5):
        out = {"tree": str(args.tree), "healthy_after_s": round(time.perf_counter() - start, 1),
               "load_average_before": os.getloadavg(), "first_single_s": first_token_s(url, 0),
               "first_six_s": six(url, 10), "warm_single_s": first_token_s(url, 20),
               "warm_six_s": six(url, 30), "load_average_after": os.getloadavg()}  # fmt: skip
    warmup = [
        line for line in args.log.read_text(errors="replace").splitlines() if "warm-up" in line
    ]
    out["warmup_log"] = warmup[-1:]
    print(json.dumps(out, indent=1))
    print(
        f"wrote {write_result(args.name, {'environment': environment(torch.device('cpu')), **out})}"
    )
    return out


if __name__ == "__main__":
    main()

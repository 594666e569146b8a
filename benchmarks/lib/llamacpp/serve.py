"""The served half of benchmarks/serving/vs_llamacpp.py: llama-cpp-python's OpenAI server
and `vlmserve serve` on the same GGUF file, driven by one load generator.

The same requests go to both: `/v1/completions`, the prompt as text (the spec's token
ids decoded; each server tokenizes it and adds BOS), greedy, streamed, `max_tokens` with
both end-of-text tokens banned through `logit_bias` (llama-cpp-python's server has no
`ignore_eos`), so both write exactly `max_tokens` tokens. TTFT: request sent to first
streamed token; TPOT: the rest of the tokens over the time they took. llama-cpp-python's
server runs one request at a time; by default a new request interrupts the one streaming
(`--interrupt_requests`), which is turned off here so that concurrent requests queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

import vlmserve
from benchmarks.lib.server_process import free_port, server_process

STARTUP_TIMEOUT_S = 600.0


@contextlib.contextmanager
def serving(name: str, spec: dict, python: Path, log: Path) -> Iterator[str]:
    """A fresh server of contender `name`, ready: its base URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    threads, gguf = str(spec["threads"]), spec["gguf"]
    if name == "llamacpp":
        env.pop("PYTHONPATH", None)
        cmd = [str(python), "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(spec["max_model_len"]), "--n_threads",
               threads, "--n_threads_batch", threads, "--n_batch", "512",
               "--interrupt_requests", "False"]  # fmt: skip
        health = "/v1/models"
    else:
        env.update(vlmserve.ENGINE_OPENMP)
        quantization = name.removeprefix("vlmserve_").replace("bf16", "none")
        cmd = [sys.executable, "-m", "vlmserve.cli", "serve", "--model", gguf, "--host",
               "127.0.0.1", "--port", str(port), "--quantization", quantization,
               "--max-model-len", str(spec["max_model_len"]), "--max-num-seqs", "64",
               "--max-num-batched-tokens", "2048", "--served-model-name", "bench"]  # fmt: skip
        health = "/health"
    url = f"http://127.0.0.1:{port}"
    repo = Path(__file__).resolve().parents[2]
    with server_process(cmd, env, repo, log, url, name, STARTUP_TIMEOUT_S, 0.5, health):
        yield url


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                tokens += 1  # one streamed chunk a token on both servers
                first = first if first is not None else time.perf_counter() - start
    total = time.perf_counter() - start
    first = total if first is None else first
    return {"ttft_s": first, "tpot_s": (total - first) / max(1, tokens - 1), "chunks": tokens,
            "seconds": total}  # fmt: skip


def bodies(items: list[dict], tokenizer, banned: list[int]) -> list[dict]:
    return [
        {
            "model": "bench",
            "prompt": tokenizer.decode(item["prompt_token_ids"][1:]),  # BOS: the server's
            "max_tokens": item["max_tokens"],
            "temperature": 0.0,
            "stream": True,
            "logit_bias": {str(t): -100 for t in banned},
        }
        for item in items
    ]


async def run_scenarios(url: str, spec: dict, tokenizer, banned: list[int]) -> dict:
    out = {}
    timeout = httpx.Timeout(1800.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        for body in bodies(spec["warmup"], tokenizer, banned):
            await one_request(client, url, body)
        for name, items in spec["scenarios"].items():
            start = time.perf_counter()
            reqs = bodies(items, tokenizer, banned)
            if name == "batch1":
                results = [await one_request(client, url, body) for body in reqs]
            else:
                results = await asyncio.gather(*(one_request(client, url, b) for b in reqs))
            seconds = time.perf_counter() - start
            out[name] = {
                "seconds": seconds,
                "output_tok_s": sum(r["chunks"] for r in results) / seconds,
                "ttft_ms_p50": 1e3 * statistics.median(r["ttft_s"] for r in results),
                "ttft_ms_max": 1e3 * max(r["ttft_s"] for r in results),
                "tpot_ms_p50": 1e3 * statistics.median(r["tpot_s"] for r in results),
                "chunks": [r["chunks"] for r in results],
            }
    return out


def serve_round(name: str, spec: dict, python: Path, workdir: Path, tag: str) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.lib.real_model import fetch_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(str(fetch_hf_dir()))
    banned = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")})
    with serving(name, spec, python, workdir / f"{tag}.log") as url:
        result = asyncio.run(run_scenarios(url, spec, tokenizer, banned))
    shown = {k: round(v["output_tok_s"], 1) for k, v in result.items()}
    print(f"  {tag} (served): output tok/s {shown}", flush=True)
    return result

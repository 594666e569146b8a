"""The llama.cpp side of benchmarks/serving/vs_llamacpp.py, run by the llama.cpp
environment's Python (benchmarks/lib/llamacpp/__init__.py): no project imports.

    python worker.py SPEC.json RESULT.json

Each request: the KV cache reset (no prefix reuse between requests), its prompt token ids
evaluated, then greedy tokens until max_tokens (EOS not stopping it: `generate` yields
tokens until its caller stops). llama-cpp-python decodes one sequence at a time, so a
scenario of N concurrent requests runs them in turn.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_one(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first, seconds to the last)."""
    llm.reset()
    start = time.perf_counter()
    tokens, first = [], 0.0
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        if not tokens:
            first = time.perf_counter() - start
        tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    return tokens, first, time.perf_counter() - start


def main(spec_path: str, result_path: str) -> None:
    from llama_cpp import Llama, __version__

    spec = json.loads(open(spec_path).read())
    threads = spec["threads"]
    start = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=spec["max_model_len"], n_batch=512,
                n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)  # fmt: skip
    load_s = time.perf_counter() - start
    for item in spec["warmup"]:
        run_one(llm, item["prompt_token_ids"], item["max_tokens"])
    result = {"system": "llamacpp", "version": __version__, "load_s": load_s, "scenarios": {}}
    for name, items in spec["scenarios"].items():
        start = time.perf_counter()
        runs = [run_one(llm, r["prompt_token_ids"], r["max_tokens"]) for r in items]
        result["scenarios"][name] = {
            "seconds": time.perf_counter() - start,
            "output_token_ids": [tokens for tokens, _, _ in runs],
            "ttft_s": [first for _, first, _ in runs],
            "tpot_s": [(last - first) / max(1, len(t) - 1) for t, first, last in runs],
        }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])

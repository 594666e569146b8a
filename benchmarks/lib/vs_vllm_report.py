"""The tables `benchmarks/serving/vs_vllm.py` prints from its results: the offline workloads
(time, tokens/s, ratio, greedy agreement) and the serving sweeps."""

from __future__ import annotations

import statistics
from typing import NamedTuple

from benchmarks.lib.common import table


class Agreement(NamedTuple):
    num_requests: int
    num_identical: int  # outputs equal token for token
    mean_matched_prefix: float  # tokens equal before the first difference, mean over requests
    mean_output_len: float


def matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(a: list[list[int]], b: list[list[int]]) -> Agreement:
    """How far two engines' greedy outputs for the same requests agree. Random-weight fp32
    models can part on near-ties in the logits, after which the outputs differ."""
    assert len(a) == len(b), f"{len(a)} outputs against {len(b)}"
    prefixes = [matched_prefix(x, y) for x, y in zip(a, b, strict=True)]
    identical = sum(x == y for x, y in zip(a, b, strict=True))
    return Agreement(
        len(a),
        identical,
        statistics.fmean(prefixes or [0]),
        statistics.fmean([len(x) for x in a] or [0]),
    )


def summarize(runs: list[dict], num_output_tokens: int) -> dict:
    """Medians per system over its successful rounds, and vlmserve / vLLM output tok/s."""
    out: dict = {}
    for system in ("vllm", "vlmserve"):
        ok = [r for r in runs if r["system"] == system and "error" not in r]
        if not ok:
            out[system] = None
            continue
        seconds = statistics.median(r["seconds"] for r in ok)
        out[system] = {
            "median_seconds": seconds,
            "median_output_tok_per_s": num_output_tokens / seconds,
            "rounds": len(ok),
            "load_s": statistics.median(r["load_s"] for r in ok),
            "warmup_s": statistics.median(r["warmup_s"] for r in ok),
        }
    both = out["vllm"] and out["vlmserve"]
    out["ratio_vlmserve_over_vllm"] = (
        out["vlmserve"]["median_output_tok_per_s"] / out["vllm"]["median_output_tok_per_s"]
        if both
        else None
    )
    return out


def report(name: str, result: dict) -> None:
    summary = result["summary"]
    rows = [
        {
            "system": s,
            "median_s": summary[s]["median_seconds"],
            "output_tok_per_s": summary[s]["median_output_tok_per_s"],
            "load_s": summary[s]["load_s"],
            "warmup_s": summary[s]["warmup_s"],
            "rounds": summary[s]["rounds"],
        }
        for s in ("vllm", "vlmserve")
        if summary[s]
    ]
    print(
        f"\n{name} workload ({result['num_requests']} requests, "
        f"{result['num_output_tokens']} output tokens)"
    )
    if rows:
        print(
            table(rows, ["system", "median_s", "output_tok_per_s", "load_s", "warmup_s", "rounds"])
        )
    if summary["ratio_vlmserve_over_vllm"] is not None:
        print(f"vlmserve / vLLM output tok/s: {summary['ratio_vlmserve_over_vllm']:.2f}")
    if "greedy_agreement" in result:
        g = result["greedy_agreement"]
        print(
            f"greedy agreement: {g['num_identical']}/{g['num_requests']} identical, mean "
            f"matched prefix {g['mean_matched_prefix']:.1f} of {g['mean_output_len']:.1f} "
            f"tokens; prompt tokens equal: {result['prompt_tokens_equal']}"
        )
    if "jpeg_pixels_identical" in result:
        print(f"JPEG pixels identical on both sides: {result['jpeg_pixels_identical']}")
    if "kv_bytes_per_sequence" in result:
        kv = result["kv_bytes_per_sequence"]
        for name in ("checkpoint", "gemma-3-4b", "gemma-3-27b"):
            k = kv[name]
            print(
                f"KV per sequence at {kv['context']:,} tokens, {name} ({k['num_sliding_layers']} "
                f"of {k['num_layers']} layers on a {k['sliding_window']}-token window): "
                f"{k['hybrid_bytes'] / 2**20:,.1f} MiB vs {k['all_global_bytes'] / 2**20:,.1f} "
                f"MiB all-global ({k['hybrid_over_all_global']:.0%})"
            )
    for tag, error in result["errors"].items():
        print(f"{tag} failed: {error}")


def report_serving(name: str, result: dict) -> None:
    print(f"\n{name} serving (block size {result['block_size']}, KV {result['kv_cache_gib']} GiB)")
    rows = []
    for system in ("vllm", "vlmserve"):
        sweep = result[system]
        for p in sweep["points"]:
            rows.append({"system": system, "rate": p["rate"], "req_per_s": p["completed_per_s"],
                         "ttft_p99_s": p["ttft_s"]["p99"], "tpot_p50_s": p["tpot_s"]["p50"],
                         "saturated": p["saturated"]})  # fmt: skip
        if "error" in sweep:
            print(f"{system}: {sweep['error']}")
        else:
            print(f"{system}: max sustained rate {sweep['max_sustained_rate']}, "
                  f"saturates at {sweep['saturation_rate']}")  # fmt: skip
    if rows:
        print(table(rows, ["system", "rate", "req_per_s", "ttft_p99_s", "tpot_p50_s", "saturated"]))

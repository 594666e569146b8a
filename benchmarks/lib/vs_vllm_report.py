"""The tables `benchmarks/serving/vs_vllm.py` prints from its results: the offline workloads
(time, tokens/s, ratio, greedy agreement) and the serving sweeps."""

from __future__ import annotations

from benchmarks.lib.common import table


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

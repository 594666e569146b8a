"""Replica routing at scale, simulated (issue 40): N = 2, 8, 64 engine replicas of a
LLaVA-OneVision-7B-shaped VLM (Qwen2-7B + SigLIP-so400m, H100, each with the engine's
default 256 MB encoder cache: about 58 of its images of 1-6 tiles, fewer than the trace's
working set, as a real 7B replica's would hold) on the recurring-image trace
(`search.sim.affinity_trace`, its parameters fixed from the issue's words there: half the
conversations open on one of 300 pooled images by a Zipf law of exponent 0.8, 0.3 on an
image of their own, 8 system prompts, 35% of the requests continuing a chat), routed by
the very router code `vlmserve serve --replicas N` runs:

  (a) pow2: Ray Serve's default (power of two choices on queue length),
  (b) prefix: text-prefix affinity (SGLang's and Ray Serve LLM's routers) with their
      absolute imbalance threshold,
  (c) cache_aware: ours (session, image content, block-hash prefix; affinity within
      bounded loads on queue + KV use and on the share of recent traffic; a model of
      each replica's encoder cache, the engine's 256 MB, `--no-cache-model` without),
  and two ceilings no router reaches: `oracle` (every image request sent to a replica
  whose encoder cache holds its image now, peeking into the caches and ignoring load)
  and `compulsory` (every image's first sight a miss, every later one a hit).

Ours' parameters (`CHOSEN`) were picked by `--tune` on the trace seeds `TUNING_SEEDS`
(results/replica_routing_tune.json); the figures are reported on other seeds
(`HELD_OUT_SEEDS`), which the tuning never saw. All routers see the same trace at each N
and seed. Reported per router: encoder-cache hit rate (an image found in the chosen
replica's cache on arrival), prefix-cache hit rate, TTFT p50/p99, output throughput,
load imbalance (max / mean requests per replica), routing reasons; then the issue's
checks on the mean over the held-out seeds: ours >= 1.5x pow2's encoder-cache hit rate,
TTFT p99 <= the better of (a) and (b), imbalance <= 1.3. The simulator runs on simulated
time: its figures do not depend on the machine's load, only its wall time does.

    python -m benchmarks.serving.replica_routing_sim  # → results/replica_routing_sim.json
    python -m benchmarks.serving.replica_routing_sim --tune --replicas 2 8
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from benchmarks.lib.common import table, write_result
from scheduler.routing.policy import ROUTERS, RouterConfig, encoder_cache_tokens
from search.costmodel.presets import get_accelerator, get_encoder, get_model
from search.image_budget import ImageAssumptions
from search.sim.affinity_trace import AffinityShape, affinity_trace, describe
from search.sim.cluster_sim import simulate_cluster
from search.sim.step_time import StepHardware
from search.sim.trace_sim import SimConfig
from search.sim.traces import TraceRequest

TUNING_SEEDS = (1, 2)
HELD_OUT_SEEDS = (3, 4)
# Ours, as `--tune` picked it on TUNING_SEEDS of the trace before issue 40's shape was
# fixed (the defaults of RouterConfig); nothing was tuned on the current trace.
CHOSEN = {"load_factor": 0.25, "image_first": True, "kv_weight": 4.0, "share_window": 32}
# kv_weight and share_window are not tuned here: the simulated 7B's KV pool is never more
# than a few % used at these rates, and the simulator's queues already see every load
# (the share bound is for the light loads a real cluster's stale queue figures miss).
GRID = {"load_factor": (0.1, 0.25, 0.5), "image_first": (False, True)}
COLUMNS = ["router", "encoder_hit", "enc_hit_2nd_half", "prefix_hit", "ttft_p50_ms", "ttft_p99_ms",
           "tok_s", "imbalance", "reasons", "sim_s"]  # fmt: skip
HIT, P99, IMB = "encoder_cache_hit_rate", "ttft_p99_s", "imbalance"
MIN_REQUESTS = 3000  # a trace's floor: the pool recurs (its 300 images drawn ~975 times)
SHAPE = AffinityShape()  # the trace, as search.sim.affinity_trace fixes it
TRACE_WHY = {  # fixed from the words before any routing was measured on it
    "num_images": "'a few hundred images': 300, the middle of 200-500",
    "pool_share": "'a share of requests reuse one of them': half the conversations",
    "unique_share": "the other image conversations send an image of their own (uploads)",
    "zipf_s": "Zipf-like popularity, s = 0.8: web objects measured s 0.64-0.83 "
    "(Breslau et al., INFOCOM 1999)",
    "followup_share": "'chats continue earlier turns': 35% of requests, up to 4 turns, "
    "the image resent with the history",
    "encoder_cache": "the engine's default 256 MB a replica: about 58 of the 7B's images "
    "(4.4 MB mean at 1-6 tiles), fewer than the working set, as on a real replica",
    "requests": "at least 3000 so the pool recurs (about 975 draws of its 300 images), "
    "else 150 a replica, at most 6000 (the simulator's wall time)",
}


def hardware() -> StepHardware:
    return StepHardware(
        get_model("qwen2-7b"),
        get_encoder("siglip-so400m-14-384"),
        get_accelerator("h100-sxm"),
        ImageAssumptions(workspace_bytes=4e9),
        2,
    )


def checks(rows: dict[str, dict]) -> dict[str, bool]:
    """The issue's three checks on one N's rows (by router)."""
    ours, pow2, prefix = rows["cache_aware"], rows["pow2"], rows["prefix"]
    out = {
        "encoder_hit_ge_1.5x_pow2": ours[HIT] >= 1.5 * pow2[HIT],
        "ttft_p99_le_better_of_a_b": ours[P99] <= min(pow2[P99], prefix[P99]),
        "imbalance_le_1.3": ours[IMB] <= 1.3,
    }
    half = "encoder_cache_hit_rate_2nd_half"
    if half in ours:  # the simulator's: past the caches' cold start
        out["2nd_half_encoder_hit_ge_1.5x_pow2"] = ours[half] >= 1.5 * pow2[half]
    return out


def compulsory_hit_rate(trace: list[TraceRequest]) -> float:
    """Every image's first sight a miss, every later one a hit (infinite caches)."""
    seen: set[str] = set()
    lookups = hits = 0
    for req in sorted(trace, key=lambda r: r.arrival_s):
        for im in req.images:
            lookups, hits = lookups + 1, hits + (im.content_hash in seen)
            seen.add(im.content_hash)
    return hits / max(1, lookups)


def num_requests(n: int, args: argparse.Namespace) -> int:
    """At least `min_requests` (the pool recurs: 3000 requests draw its 300 images about
    975 times), else `requests_per_replica` a replica, at most `max_requests`."""
    return max(args.min_requests, min(n * args.requests_per_replica, args.max_requests))


def make_trace(n: int, seed: int, args: argparse.Namespace) -> list[TraceRequest]:
    return affinity_trace(num_requests(n, args), n * args.rate_per_replica, SHAPE, seed=seed)


def one(trace, n: int, config: RouterConfig, args, seed: int, oracle: bool = False) -> dict:
    sim = SimConfig(encoder_cache_bytes=args.encoder_cache_mb * 2**20)
    start = time.perf_counter()
    result = simulate_cluster(trace, hardware(), n, config, sim, seed=seed, oracle=oracle)
    return result.summary() | {"sim_wall_s": time.perf_counter() - start}


def cache_tokens(args: argparse.Namespace) -> int | None:
    """A replica's encoder cache in visual tokens (the router's image weights): the
    simulator stores an image as its tokens x hidden x 2 bytes."""
    return encoder_cache_tokens(args.encoder_cache_mb * 2**20, hardware().model.hidden_size, 2)


def ours(args: argparse.Namespace, params: dict) -> RouterConfig:
    """Ours with `params`, knowing its replicas' encoder-cache size (not a tuned value:
    the engine's), unless `--no-cache-model`."""
    size = None if args.no_cache_model else cache_tokens(args)
    return RouterConfig(max_imbalance=args.max_imbalance, encoder_cache_tokens=size, **params)


def run(n: int, seed: int, args: argparse.Namespace, params: dict) -> dict:
    trace = make_trace(n, seed, args)
    rows: dict[str, dict] = {}
    for kind in ROUTERS:
        config = (
            ours(args, params) if kind == "cache_aware" else RouterConfig(kind, args.max_imbalance)
        )
        rows[kind] = one(trace, n, config, args, seed)
    if not args.no_oracle:
        rows["oracle"] = one(trace, n, ours(args, params), args, seed, oracle=True)
    printable = [
        {
            "router": kind,
            "encoder_hit": r[HIT],
            "enc_hit_2nd_half": r["encoder_cache_hit_rate_2nd_half"],
            "prefix_hit": r["prefix_cache_hit_rate"],
            "ttft_p50_ms": r["ttft_p50_s"] * 1e3,
            "ttft_p99_ms": r[P99] * 1e3,
            "tok_s": r["throughput_tok_s"],
            "imbalance": r[IMB],
            "reasons": " ".join(f"{k}:{v}" for k, v in sorted(r["reasons"].items())),
            "sim_s": r["sim_wall_s"],
        }
        for kind, r in rows.items()
    ]
    ceiling = compulsory_hit_rate(trace)
    verdict = checks(rows)
    print(f"\nN = {n}, seed {seed}: {len(trace)} requests at {n * args.rate_per_replica:g}/s")
    print(table(printable, COLUMNS))
    print(f"compulsory ceiling {ceiling:.3f}; checks: {verdict}", flush=True)
    return {"seed": seed, "num_requests": len(trace), "trace": describe(trace), "routers": rows,
            "compulsory_hit_rate": ceiling, "checks": verdict}  # fmt: skip


def mean_rows(runs: list[dict]) -> dict[str, dict]:
    """Each router's figures averaged over the seeds' runs."""
    out: dict[str, dict] = {}
    for kind in runs[0]["routers"]:
        rows = [r["routers"][kind] for r in runs]
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float))]
        out[kind] = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    return out


def summarize_n(n: int, runs: list[dict]) -> dict:
    means = mean_rows(runs)
    ours, pow2 = means["cache_aware"], means["pow2"]
    summary = {
        "hit_ratio_vs_pow2": ours[HIT] / pow2[HIT],
        "oracle_ratio_vs_pow2": means["oracle"][HIT] / pow2[HIT] if "oracle" in means else None,
        "compulsory_ratio_vs_pow2": statistics.fmean(r["compulsory_hit_rate"] for r in runs)
        / pow2[HIT],
    }
    # TTFT p99 per seed: the seed-to-seed spread is the noise a p99 difference is read against
    summary["ttft_p99_ms_by_seed"] = {
        k: [round(r["routers"][k][P99] * 1e3, 2) for r in runs] for k in means
    }
    verdict = checks(means)
    print(f"\nN = {n}, mean over seeds {[r['seed'] for r in runs]}: {summary}\nchecks: {verdict}")
    return {"num_replicas": n, "runs": runs, "mean": means, "summary": summary,
            "checks": verdict}  # fmt: skip


def tune(args: argparse.Namespace) -> None:
    """The grid on TUNING_SEEDS; the pick: every check passed in every tuning run, then
    the highest mean hit ratio over pow2 (else the most checks passed)."""
    fixed = {k: v for k, v in CHOSEN.items() if k not in GRID}
    points = [fixed | dict(zip(GRID, v, strict=True)) for v in itertools.product(*GRID.values())]
    baselines = {}
    for n, seed in itertools.product(args.replicas, args.seeds):
        trace = make_trace(n, seed, args)
        base = {
            k: one(trace, n, RouterConfig(k, args.max_imbalance), args, seed) for k in ROUTERS[:2]
        }
        baselines[n, seed] = (trace, base)
    scored = []
    for params in points:
        passed, ratios = 0, []
        for (n, seed), (trace, base) in baselines.items():
            row = one(trace, n, ours(args, params), args, seed)
            verdict = checks(base | {"cache_aware": row})
            passed += sum(verdict.values())
            ratios.append(row[HIT] / base["pow2"][HIT])
            print(params, n, seed, f"ratio {ratios[-1]:.3f} p99 {row[P99] * 1e3:.1f} ms "
                  f"imbalance {row[IMB]:.3f} {verdict}", flush=True)  # fmt: skip
        mean_ratio = statistics.fmean(ratios)
        scored.append({"params": params, "checks_passed": passed, "mean_ratio": mean_ratio})
    best = max(scored, key=lambda s: (s["checks_passed"], s["mean_ratio"]))
    print("pick:", best)
    path = write_result("replica_routing_tune", {
        "tuning_seeds": args.seeds, "replicas": args.replicas, "grid": GRID,
        "baselines": {f"N={n} seed={s}": {k: {m: v[m] for m in (HIT, P99, IMB)}
                                          for k, v in b[1].items()}
                      for (n, s), b in baselines.items()},
        "scored": scored, "pick": best,
    })  # fmt: skip
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 8, 64])
    p.add_argument("--seeds", type=int, nargs="+", help="default: held-out (tune: tuning) ones")
    p.add_argument("--requests-per-replica", type=int, default=150)
    p.add_argument("--min-requests", type=int, default=MIN_REQUESTS, help="the pool recurs")
    p.add_argument("--max-requests", type=int, default=6000, help="cap (64 replicas: 94 each)")
    p.add_argument("--rate-per-replica", type=float, default=8.0, help="arrivals/s per replica")
    p.add_argument("--encoder-cache-mb", type=float, default=256.0)
    p.add_argument("--max-imbalance", type=int, default=2, help="the prefix router's bound")
    p.add_argument("--no-oracle", action="store_true")
    p.add_argument("--no-cache-model", action="store_true",
                   help="ours without its model of the replicas' encoder caches")  # fmt: skip
    p.add_argument("--tune", action="store_true", help="the grid on TUNING_SEEDS")
    p.add_argument("--name", default="replica_routing_sim")
    args = p.parse_args()
    args.seeds = args.seeds or list(TUNING_SEEDS if args.tune else HELD_OUT_SEEDS)
    if args.tune:
        tune(args)
        return
    results = []
    for n in args.replicas:  # the file is rewritten after each N: a cut run keeps its rows
        results.append(summarize_n(n, [run(n, s, args, CHOSEN) for s in args.seeds]))
        path = _write(args, results)
    print(f"wrote {path}")


def _write(args: argparse.Namespace, results: list[dict]):
    return write_result(args.name, {
        "hardware": "qwen2-7b + siglip-so400m-14-384 on h100-sxm (simulated)",
        "trace": {"shape": SHAPE.__dict__, "why": TRACE_WHY,
                  "requests": {str(n): num_requests(n, args) for n in args.replicas},
                  "min_requests": args.min_requests,
                  "requests_per_replica": args.requests_per_replica,
                  "max_requests": args.max_requests,
                  "rate_per_replica": args.rate_per_replica},
        "seeds": {"tuning": TUNING_SEEDS, "reported_held_out": args.seeds,
                  "held_out": sorted(set(args.seeds) - set(TUNING_SEEDS)) == sorted(args.seeds)},
        "cache_aware_params": CHOSEN,
        "cache_aware_encoder_cache_tokens": None if args.no_cache_model
        else cache_tokens(args),
        "encoder_cache_mb": args.encoder_cache_mb,
        "prefix_max_imbalance": args.max_imbalance,
        "results": results,
    })  # fmt: skip


if __name__ == "__main__":
    main()

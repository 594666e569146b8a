"""``vlmserve estimate capacity``: a trace (a file or a named mix) through the real
scheduler on the cost model's clock (search/sim/trace_sim.py), reported as per-class latency
percentiles, goodput under an SLO and, with ``--find-max-rate``, the highest arrival
rate (and users in flight) the accelerator holds at that SLO."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.config import SchedulerConfig, SloConfig
from scheduler.routing.policy import ROUTERS, RouterConfig, encoder_cache_tokens
from search.costmodel.presets import (
    ENCODERS,
    MODEL_VISION,
    get_accelerator,
    get_cache_precision,
    get_encoder,
    get_model,
)
from search.image_budget import ImageAssumptions
from search.sim.affinity_trace import affinity_trace
from search.sim.capacity import RateSearch, Slo, Summary, find_max_rate, summarize
from search.sim.cluster_sim import ClusterResult, simulate_cluster
from search.sim.step_time import StepHardware
from search.sim.trace_sim import SimConfig, SimResult, simulate
from search.sim.traces import MIXES, TraceRequest, make_mix, read_jsonl
from vlmserve.cli.estimate.plot import Curve

Row = tuple[str, str]
Outcome = tuple[dict[str, Any], list[Row], Callable[[], list[Curve]]]


def default_admission() -> str:
    """The scheduler's own default when it has an admission choice, else fcfs."""
    for f in dataclasses.fields(SchedulerConfig):
        if f.name == "admission":
            return str(f.default)
    return "fcfs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--mix", choices=(*MIXES, "affinity"), default="vlm",
        help="named mix (default: vlm; affinity: recurring images, system prompts and chats)",
    )  # fmt: skip
    source.add_argument("--trace", metavar="FILE.jsonl", help="a trace file instead of a mix")
    p.add_argument("--num-requests", type=int, default=1000, help="mix size (default: 1000)")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="arrivals per second (mix default: 2; a trace keeps its own unless given)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--find-max-rate",
        action="store_true",
        help="search the highest rate whose SLO attainment stays >= --slo-attainment",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--slo-attainment", type=float, default=0.9)
    p.add_argument(
        "--admission",
        choices=("fcfs", "lumpy"),
        default=None,
        help=f"admission policy (default: the scheduler's, here {default_admission()})",
    )
    p.add_argument(
        "--encoder", default=None,
        help=f"{', '.join(sorted(ENCODERS))} (default: the model's own, else siglip-so400m-14-384)",
    )  # fmt: skip
    p.add_argument(
        "--pooling", type=int, default=None,
        help="connector ratio N:1 (default: the model's own, Gemma 3 16, else 4)",
    )  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--preprocess-workers", type=int, default=8)
    p.add_argument("--encoder-cache-gb", type=float, default=4.0)
    p.add_argument("--replicas", type=int, default=1, help="engine replicas behind a router")
    p.add_argument(
        "--router", choices=ROUTERS, default="cache_aware",
        help="how requests pick a replica (with --replicas > 1): as `vlmserve serve --router`",
    )  # fmt: skip
    p.add_argument("--router-max-imbalance", type=int, default=2, help="as `vlmserve serve`'s")
    p.add_argument("--router-load-factor", type=float, default=0.25, help="as `vlmserve serve`'s")


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f}"


def _trace_maker(args: argparse.Namespace) -> tuple[Callable[[float], list[TraceRequest]], float]:
    """Trace at a given rate (a mix regenerated, or the file's arrivals rescaled), and the
    rate to run at when no search is asked for."""
    if args.num_requests < 1 or (args.rate is not None and args.rate <= 0):
        raise ValueError("--num-requests must be >= 1 and --rate > 0")
    if args.trace is None:
        rate = 2.0 if args.rate is None else args.rate
        if args.mix == "affinity":
            return (lambda r: affinity_trace(args.num_requests, r, seed=args.seed)), rate
        return (lambda r: make_mix(args.mix, args.num_requests, r, args.seed)), rate
    base = read_jsonl(args.trace)
    span = base[-1].arrival_s - base[0].arrival_s
    if span <= 0:
        if args.find_max_rate or args.rate is not None:
            raise ValueError(f"trace {args.trace}: all arrivals at one instant, no rate to scale")
        return (lambda r: base), 0.0
    base_rate = len(base) / span

    def at(rate: float) -> list[TraceRequest]:
        scale = base_rate / rate
        return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in base]

    return at, base_rate if args.rate is None else args.rate


def run_capacity(args: argparse.Namespace) -> Outcome:
    model, accel = get_model(args.model), get_accelerator(args.accelerator)
    own_encoder, own_pooling = MODEL_VISION.get(model.name, ("siglip-so400m-14-384", 4))
    args.encoder = args.encoder or own_encoder
    args.pooling = own_pooling if args.pooling is None else args.pooling
    encoder = get_encoder(args.encoder)
    cache = get_cache_precision(args.kv_dtype)
    hw = StepHardware(
        model,
        encoder,
        accel,
        ImageAssumptions(workspace_bytes=args.workspace_gb * 1e9),
        cache.bytes_per_element,
    )
    admission = args.admission or default_admission()
    config = SimConfig(
        admission=admission,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        pooling_ratio=args.pooling,
        preprocess_workers=args.preprocess_workers,
        encoder_cache_bytes=args.encoder_cache_gb * 1e9,
        # The targets reported against are also the ones lumpy admission plans with.
        slo=SloConfig(args.slo_ttft_ms * 1e-3, args.slo_tpot_ms * 1e-3),
    )
    slo = Slo(args.slo_ttft_ms * 1e-3, args.slo_tpot_ms * 1e-3)
    make_trace, rate = _trace_maker(args)
    if args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: must be >= 1")
    # Ours models each replica's encoder cache as `vlmserve serve --replicas` does: its
    # bytes over a visual token's (the simulator stores hidden x 2 bytes a token).
    cache_tokens = encoder_cache_tokens(config.encoder_cache_bytes, model.hidden_size, 2)
    router = RouterConfig(
        args.router, args.router_max_imbalance, args.router_load_factor,
        encoder_cache_tokens=cache_tokens if args.router == "cache_aware" else None,
    )  # fmt: skip
    clusters: list[ClusterResult] = []

    def run(trace: list[TraceRequest]) -> SimResult:
        if args.replicas == 1:
            return simulate(trace, hw, config)
        clusters.append(simulate_cluster(trace, hw, args.replicas, router, config, args.seed))
        return clusters[-1].merged()

    search: RateSearch | None = None
    if args.find_max_rate:
        hi = 64.0 * args.replicas
        search = find_max_rate(make_trace, hw, config, slo, args.slo_attainment, hi=hi, run=run)
        rate = search.max_rate or search.tried[0][0]
    trace = make_trace(rate)
    result = run(trace)
    summary = summarize(result, slo)
    source = f"trace {Path(args.trace).name}" if args.trace else f"mix {args.mix}"
    title = (
        f"capacity: {model.name} + {encoder.name} on {accel.name}, {source}, "
        f"{admission} admission, SLO TTFT {args.slo_ttft_ms:g} ms / TPOT {args.slo_tpot_ms:g} ms"
    )
    rows = _rows(summary, result, rate, search, trace)
    routing = clusters[-1].summary() if clusters else None
    if routing is not None:
        title += f"; {args.replicas} replicas, router {args.router}"
        rows.insert(0, ("replicas", _routing_row(routing)))
    skip = {"func", "json", "plot", "estimate_command"}
    payload: dict[str, Any] = {
        "title": title,
        "inputs": {k: v for k, v in vars(args).items() if k not in skip} | {"admission": admission},
        "model": dataclasses.asdict(model) | {"num_params": model.num_params},
        "accelerator": dataclasses.asdict(accel),
        "rate": rate,
        "results": dataclasses.asdict(summary),
        "rate_search": None if search is None else dataclasses.asdict(search),
        "timeline": [list(p) for p in result.timeline],
        "routing": routing,
        "router": dataclasses.asdict(router) if clusters else None,
    }

    def curves() -> list[Curve]:
        ts = [t for t, _, _ in result.timeline]
        kv = [100 * f for _, f, _ in result.timeline]
        queued = [q for _, _, q in result.timeline]
        return [
            Curve(ts, kv, "time (s)", "KV blocks in use (%)", log_x=False, marker=None),
            Curve(ts, queued, "time (s)", "requests waiting", log_x=False, marker=None),
        ]

    return payload, rows, curves


def _routing_row(r: dict[str, Any]) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))
    return (
        f"{r['num_replicas']}: encoder-cache hits {r['encoder_cache_hit_rate']:.1%}, prefix-cache "
        f"{r['prefix_cache_hit_rate']:.1%}, imbalance {r['imbalance']:.2f} (max/mean "
        f"requests), routed by {reasons}"
    )


def _rows(
    s: Summary,
    result: SimResult,
    rate: float,
    search: RateSearch | None,
    trace: list[TraceRequest],
) -> list[Row]:
    rows: list[Row] = [
        ("requests", f"{len(trace):,} at {rate:.3g}/s ({s.num_refused} refused at arrival)"),
        ("KV pool", f"{s.num_blocks:,} blocks, peak {s.peak_kv_occupancy:.0%} in use"),
    ]
    for c in s.classes:
        rows.append(
            (
                f"{c.request_class} (n={c.num_requests})",
                f"TTFT p50/p99 {_ms(c.ttft_p50_s)}/{_ms(c.ttft_p99_s)} ms, "
                f"TPOT p50/p99 {_ms(c.tpot_p50_s)}/{_ms(c.tpot_p99_s)} ms, "
                f"E2E p99 {_ms(c.e2e_p99_s)} ms, SLO met {c.num_slo_met}/{c.num_requests}",
            )
        )
    for c in s.by_images:  # the SLO classes, as /metrics labels them
        rows.append(
            (
                f"class {c.request_class} (n={c.num_requests})",
                f"SLO met {c.num_slo_met}/{c.num_requests} ({c.num_slo_met / c.num_requests:.1%}), "
                f"TTFT p50/p90/p99 {_ms(c.ttft_p50_s)}/{_ms(c.ttft_p90_s)}/{_ms(c.ttft_p99_s)} ms, "
                f"TPOT p50/p99 {_ms(c.tpot_p50_s)}/{_ms(c.tpot_p99_s)} ms",
            )
        )
    rows += [
        ("goodput", f"{s.goodput_rps:.3g} req/s ({s.slo_attainment:.1%} met the SLO)"),
        ("throughput", f"{s.throughput_rps:.3g} req/s, {s.output_tokens_per_s:,.0f} output tok/s"),
        ("preemptions", f"{s.num_preemptions:,} ({s.num_recomputed_tokens:,} tokens recomputed)"),
        ("ViT tiles encoded", f"{s.num_tiles_encoded:,}"),
        ("lost / hang", f"{s.num_lost} / {'yes' if s.hang else 'no'}"),
    ]
    if search is not None:
        mean_e2e = [r.e2e_s for r in result.records if r.e2e_s is not None]
        in_flight = rate * sum(mean_e2e) / len(mean_e2e) if mean_e2e else 0.0
        rows.append(
            (
                "max rate at SLO",
                f"{search.max_rate:.3g} req/s (>= {search.target_attainment:.0%} met); "
                f"about {in_flight:,.0f} requests in flight (Little's law)",
            )
        )
    return rows

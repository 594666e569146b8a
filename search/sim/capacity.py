"""What a simulated run means for users: latency percentiles per request class, goodput
under an SLO (§13: requests that meet their latency targets, per second), and the
highest arrival rate of a mix that still meets the SLO: "how many users does it hold".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from search.sim.step_time import StepHardware
from search.sim.trace_sim import RequestRecord, SimConfig, SimResult, simulate
from search.sim.traces import TraceRequest


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO targets must be > 0, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")

    def met_by(self, rec: RequestRecord) -> bool:
        ttft, tpot = rec.ttft_s, rec.tpot_s
        if rec.finish_s is None or ttft is None:
            return False
        return ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class ClassStats:
    request_class: str
    num_requests: int
    num_refused: int
    num_finished: int
    num_slo_met: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None


def class_stats(name: str, records: list[RequestRecord], slo: Slo) -> ClassStats:
    done = [r for r in records if r.finish_s is not None]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    return ClassStats(
        request_class=name,
        num_requests=len(records),
        num_refused=sum(1 for r in records if r.refused is not None),
        num_finished=len(done),
        num_slo_met=sum(1 for r in records if slo.met_by(r)),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50),
        tpot_p99_s=percentile(tpot, 99),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p99_s=percentile(e2e, 99),
    )


@dataclass(frozen=True)
class Summary:
    classes: list[ClassStats]  # one per request class, then "all"
    goodput_rps: float  # SLO-meeting requests per second of the run (first arrival → end)
    throughput_rps: float  # finished requests per second, SLO or not
    slo_attainment: float  # SLO-meeting share of the requests the run was given
    output_tokens_per_s: float
    num_preemptions: int
    num_recomputed_tokens: int
    num_tiles_encoded: int
    num_refused: int
    num_lost: int
    hang: bool
    num_steps: int
    duration_s: float
    num_blocks: int
    peak_kv_occupancy: float
    # "text" and "image" (whether a request carries images), as the server's metrics and
    # the scheduler's SLO targets count them, whatever the trace's own class names.
    by_images: list[ClassStats] = dataclasses.field(default_factory=list)


def summarize(result: SimResult, slo: Slo) -> Summary:
    records = result.records
    by_class: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_class.setdefault(r.request_class, []).append(r)
    classes = [class_stats(name, recs, slo) for name, recs in sorted(by_class.items())]
    classes.append(class_stats("all", records, slo))
    start = min(r.arrival_s for r in records)
    duration = max(result.end_s - start, 1e-9)
    good = sum(1 for r in records if slo.met_by(r))
    finished = [r for r in records if r.finish_s is not None]
    return Summary(
        classes=classes,
        goodput_rps=good / duration,
        throughput_rps=len(finished) / duration,
        slo_attainment=good / len(records),
        output_tokens_per_s=sum(r.num_output_tokens for r in finished) / duration,
        num_preemptions=result.num_preemptions,
        num_recomputed_tokens=result.num_recomputed_tokens,
        num_tiles_encoded=result.num_tiles_encoded,
        num_refused=sum(1 for r in records if r.refused is not None),
        num_lost=result.num_lost,
        hang=result.hang,
        num_steps=result.num_steps,
        duration_s=duration,
        num_blocks=result.num_blocks,
        peak_kv_occupancy=max((f for _, f, _ in result.timeline), default=0.0),
        by_images=[
            class_stats(name, group, slo)
            for name in ("text", "image")
            if (group := [r for r in records if (r.num_images > 0) == (name == "image")])
        ],
    )


@dataclass(frozen=True)
class RateSearch:
    max_rate: float  # highest rate tried that met the target (0.0 if none did)
    target_attainment: float
    tried: list[tuple[float, float]]  # (rate, SLO attainment) in the order tried


def find_max_rate(
    make_trace: Callable[[float], list[TraceRequest]],
    hw: StepHardware,
    config: SimConfig,
    slo: Slo,
    target_attainment: float = 0.9,
    lo: float = 0.05,
    hi: float = 64.0,
    iterations: int = 8,
    run: Callable[[list[TraceRequest]], SimResult] | None = None,
) -> RateSearch:
    """Bisect (geometrically) for the highest arrival rate whose SLO attainment stays at
    or above `target_attainment`; the trace is regenerated (same seed) at each rate.
    `run` simulates a trace (default: one engine, `simulate` on `hw` with `config`)."""
    run = run or (lambda trace: simulate(trace, hw, config))
    if not 0 < target_attainment <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target_attainment}")
    tried: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        attained = summarize(run(make_trace(rate)), slo).slo_attainment
        tried.append((rate, attained))
        return attained >= target_attainment

    if not ok(lo):
        return RateSearch(0.0, target_attainment, tried)
    if ok(hi):
        return RateSearch(hi, target_attainment, tried)
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return RateSearch(lo, target_attainment, tried)

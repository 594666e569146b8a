"""Lumpy admission on traffic it was not tuned to (issue 32): mixes drawn from shapes and
seeds fixed before any run (multi-image share 10-50%, Pareto and log-normal outputs,
bursts and none), and issue 32's independent trace. Per mix: FCFS and lumpy side by side,
SLO attainment per class (text / image), goodput and its ratio, hangs, lost requests,
never-fits refused at arrival. Lumpy runs with the SLO as its planning target (slack
order, TPOT guard priced by the simulator's step-time model); FCFS has no such input.
Lumpy's goodput must reach 1.15x FCFS's where FCFS misses the SLO attainment goal
(`SLO_ATTAINMENT_GOAL`: 99% of the requests that can finish at all served within the SLO).
Used by benchmarks/serving/lumpy_admission.py."""

from __future__ import annotations

import dataclasses
import time

from scheduler.config import SloConfig
from search.costmodel.presets import get_accelerator, get_encoder, get_model
from search.sim.capacity import Slo, summarize
from search.sim.shaped_traces import INDEPENDENT, TraceShape, shaped_trace
from search.sim.step_time import StepHardware
from search.sim.trace_sim import SimConfig, SimResult, simulate
from search.sim.traces import TraceRequest

SLO = Slo(ttft_s=2.0, tpot_s=0.1)  # the default
# Seeds chosen once, before any run of these mixes; never changed to make a mix pass.
SEEDS = (101, 202)
SHAPES = (
    # Rates set for a loaded card (first tried at 5-8 req/s, where FCFS met the SLO for
    # all but the never-fits on every mix and nothing could be compared).
    TraceShape("img10-pareto-steady", 16.0, 90.0, 0.10, (1, 4), output="pareto"),
    TraceShape("img30-lognormal-bursts", 10.0, 90.0, 0.30, (1, 4), output="lognormal",
               output_scale=80.0, output_shape=0.8, burst_size=10, burst_period_s=30.0),
    TraceShape("img50-pareto-bursts", 7.0, 90.0, 0.50, (1, 2), output="pareto",
               burst_size=15, burst_period_s=20.0),
    TraceShape("img50-lognormal-steady", 7.0, 90.0, 0.50, (2, 4), output="lognormal",
               output_scale=64.0, output_shape=1.0),
)  # fmt: skip
GOAL_GOODPUT_RATIO = 1.15


def preset_hardware() -> StepHardware:
    """The card the lumpy benchmarks simulate: H100, MHA-7B, SigLIP So400m (§17)."""
    return StepHardware(
        get_model("mha-7b"), get_encoder("siglip-so400m-14-384"), get_accelerator("h100")
    )


# The SLO attainment goal: the share of requests that can finish at all (never-fits are
# refused) served within the SLO, as DistServe states its targets (e.g. 90% of requests
# within both TTFT and TPOT). FCFS "misses the SLO" on a mix when it attains less than
# this; only there must lumpy's goodput reach GOAL_GOODPUT_RATIO x FCFS's. Where FCFS
# misses a handful of ~900 requests, 1.15x is out of reach for any policy (the ceiling,
# finishable / FCFS-met, is reported): the mix meets the goal under FCFS already.
SLO_ATTAINMENT_GOAL = 0.99


def run_policy(
    admission: str, trace: list[TraceRequest], hw: StepHardware
) -> tuple[dict, SimResult]:
    """One policy on `trace`: its table row and the run (per-request records)."""
    slo = SloConfig(SLO.ttft_s, SLO.tpot_s) if admission == "lumpy" else SloConfig()
    t0 = time.perf_counter()
    result = simulate(trace, hw, SimConfig(admission=admission, slo=slo))
    wall = time.perf_counter() - t0
    s = summarize(result, SLO)
    classes = {c.request_class: c for c in s.classes}
    row: dict = {"admission": admission}
    for cls in ("text", "image"):
        c = classes.get(cls)
        row[f"{cls}_met"] = f"{c.num_slo_met}/{c.num_requests}" if c else "-"
        row[f"{cls}_attainment"] = c.num_slo_met / c.num_requests if c else None
        row[f"{cls}_ttft_p99_ms"] = (
            None if c is None or c.ttft_p99_s is None else c.ttft_p99_s * 1e3
        )
        row[f"{cls}_tpot_p99_ms"] = (
            None if c is None or c.tpot_p99_s is None else c.tpot_p99_s * 1e3
        )
    never = [r for r in result.records if r.request_id.startswith("n")]
    row |= {
        "goodput_rps": s.goodput_rps,
        "slo_attainment": s.slo_attainment,
        "peak_kv": s.peak_kv_occupancy,
        "steps": s.num_steps,
        "preemptions": s.num_preemptions,
        "hangs": int(s.hang),
        "lost": s.num_lost,
        "never_fits_refused": f"{sum(r.refused is not None for r in never)}/{len(never)}",
        "sim_wall_s": wall,
    }
    return row, result


def run_mix(name: str, trace: list[TraceRequest], hw: StepHardware) -> dict:
    """FCFS and lumpy on `trace`: the mix's JSON section (rows and checks)."""
    return compare(name, trace, run_policy("fcfs", trace, hw)[0], run_policy("lumpy", trace, hw)[0])


def compare(name: str, trace: list[TraceRequest], fcfs: dict, lumpy: dict) -> dict:
    """The mix's section from the two policies' rows (`run_policy`)."""
    lumpy["goodput_vs_fcfs"] = lumpy["goodput_rps"] / fcfs["goodput_rps"]
    fcfs["goodput_vs_fcfs"] = 1.0
    # FCFS misses the SLO: for a request that finishes at all (never-fits never do).
    finished = sum(1 for r in trace if r.max_tokens < 1 << 20)
    fcfs_met = round(fcfs["slo_attainment"] * len(trace))
    fcfs_attainment = fcfs_met / max(1, finished)
    fcfs_misses = fcfs_attainment < SLO_ATTAINMENT_GOAL
    finished_ok = all(r["hangs"] == 0 and r["lost"] == 0 for r in (fcfs, lumpy))
    checks = {
        f"{cls}_attainment_at_least_fcfs": (lumpy[f"{cls}_attainment"] or 0)
        >= (fcfs[f"{cls}_attainment"] or 0)
        for cls in ("text", "image")
    }
    ceiling = finished / max(1, fcfs_met)  # goodput is capped by what finishes at all
    checks["goodput_1.15x_where_fcfs_misses"] = (
        not fcfs_misses or lumpy["goodput_vs_fcfs"] >= GOAL_GOODPUT_RATIO
    )
    checks["no_hang_no_loss_never_fits_refused"] = finished_ok and all(
        r["never_fits_refused"].split("/")[0] == r["never_fits_refused"].split("/")[1]
        for r in (fcfs, lumpy)
    )
    return {
        "mix": name,
        "num_requests": len(trace),
        "num_image": sum(1 for r in trace if r.images),
        "goodput_ceiling_vs_fcfs": ceiling,
        "fcfs_attainment_of_finishable": fcfs_attainment,
        "fcfs_misses_slo": fcfs_misses,  # below SLO_ATTAINMENT_GOAL
        "rows": [fcfs, lumpy],
        "checks": checks,
    }


def mixes(quick: bool) -> list[tuple[str, list[TraceRequest]]]:
    out = []
    for shape in SHAPES:
        for seed in SEEDS[:1] if quick else SEEDS:
            s = dataclasses.replace(shape, duration_s=45.0) if quick else shape
            out.append((f"{shape.name}/seed{seed}", shaped_trace(s, seed)))
    return out


def independent(quick: bool, seed: int = 32) -> tuple[str, list[TraceRequest]]:
    shape = dataclasses.replace(INDEPENDENT, duration_s=100.0) if quick else INDEPENDENT
    return f"independent-{shape.duration_s:g}s/seed{seed}", shaped_trace(shape, seed)


COLUMNS = [
    "admission", "text_met", "image_met", "text_ttft_p99_ms", "image_ttft_p99_ms",
    "image_tpot_p99_ms", "goodput_rps", "goodput_vs_fcfs", "peak_kv", "steps", "hangs",
    "lost", "never_fits_refused",
]  # fmt: skip

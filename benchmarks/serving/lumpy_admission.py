"""Lumpy admission: steady text chat plus bursts of 4-image 13-tile requests, simulated.

The trace simulator (search/sim/trace_sim.py) drives the real scheduler on the cost model's
clock: H100 preset, MHA-7B backbone, SigLIP So400m tower (§17: one 13-tile image is
2,370 tokens and 1.24 GB of KV, so a burst needs more KV than the card has). FCFS with
a watermark is the baseline; the lumpy policy runs in the same process on the same trace
when this checkout's scheduler has it, without latency targets and planning against the
SLO (`lumpy+slo`, as `serve --slo-ttft-ms --slo-tpot-ms`). Per policy: the text
requests' p99 TTFT against their unloaded value (the same text traffic without the
bursts), goodput under the SLO, the requests that missed it by class, preemptions,
recomputed tokens, hangs, lost requests, never-fits refused at arrival.

Two workloads, both reported:

- ``one-burst`` (the first one): 40 burst requests at t=60 s in a 180 s run. Here no
  policy can reach 1.3x FCFS's goodput: FCFS already meets the SLO for 1,462 of the 1,821
  requests, and 1,819 finish at all (two never-fits are refused), so even if every one met
  it goodput would be 1,819 / 1,462 = 1.24x FCFS's (``goodput_ceiling_vs_fcfs``). The
  lumpy policy misses only burst requests, few of which any policy can serve within a 1 s
  TTFT: each takes ~0.44 s of the whole card's compute, and the 40 arrive within 2 s.
  ``goodput_bound_vs_fcfs`` is a computed upper bound on any policy's goodput
  (benchmarks/serving/goodput_bound.py: every finishable text request met, at most the
  burst requests whose least compute fits between the burst's first arrival and last
  deadline, over the shortest run the trace allows); the goodput check is
  goodput >= min(1.3x, that bound) x FCFS's.
- ``burst-every-60s``: the same burst at t=30, 90 and 150 s (new images each time), as
  a document-ingestion client would send beside the chat. Heavy but sustainable: each
  burst drains in ~25 s, before the next. FCFS's head-of-line blocking then holds the
  chat back after every burst (45% of text requests miss the SLO instead of 18%): this
  is where the two policies should differ by 1.3x or more. It is also the harder case
  for the text p99 target, since three times as many text requests arrive mid-burst.

Then traffic the policy was not tuned to (benchmarks/serving/lumpy_mixes.py, issue 32):
seeded mixes of several shapes and issue 32's independent trace, FCFS and lumpy (with the
SLO as its planning target) side by side per class.

    python -m benchmarks.serving.lumpy_admission   # → benchmarks/results/lumpy_admission.{json,png}
    python -m benchmarks.serving.lumpy_admission --quick   # one seed, 45 s mixes, 100 s trace
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import Counter

from benchmarks.lib.common import RESULTS, table, write_result
from benchmarks.serving import lumpy_mixes
from benchmarks.serving.goodput_bound import goodput_bound
from scheduler.config import SchedulerConfig, SloConfig
from search.sim.capacity import Slo, Summary, summarize
from search.sim.step_time import StepHardware
from search.sim.trace_sim import SimConfig, SimResult, simulate
from search.sim.traces import TraceRequest, lumpy_trace

TEXT_RATE = 10.0  # text chat requests per second
DURATION_S = 180.0
# 4 images × 13 tiles ≈ 9,500 tokens each: 40 of them ≈ 3.2× the KV pool (7,534 blocks
# of 16), so a burst hurts under any policy.
NUM_BURST = 40
BURST_WINDOW_S = 2.0
BURST_PERIOD_S = 60.0
NUM_NEVER_FITS = 2
SLO = Slo(ttft_s=1.0, tpot_s=0.1)
TARGET_TEXT_P99_MULTIPLE = 2.0
TARGET_GOODPUT_RATIO = 1.3


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    burst_at_s: float  # the first burst
    num_bursts: int  # one every BURST_PERIOD_S

    def trace(self, seed: int) -> list[TraceRequest]:
        return lumpy_trace(
            TEXT_RATE, DURATION_S, self.burst_at_s, NUM_BURST, BURST_WINDOW_S, seed,
            NUM_NEVER_FITS, num_bursts=self.num_bursts, burst_period_s=BURST_PERIOD_S,
        )  # fmt: skip

    @property
    def burst_starts(self) -> list[float]:
        return [self.burst_at_s + k * BURST_PERIOD_S for k in range(self.num_bursts)]


WORKLOADS = (Workload("one-burst", 60.0, 1), Workload("burst-every-60s", 30.0, 3))


def policies() -> list[str]:
    """FCFS, lumpy without latency targets, and lumpy planning against the SLO (what
    `serve --slo-ttft-ms --slo-tpot-ms` runs)."""
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return ["fcfs", "lumpy", "lumpy+slo"] if "admission" in fields else ["fcfs"]


def sim_config(policy: str) -> SimConfig:
    if policy == "lumpy+slo":
        return SimConfig(admission="lumpy", slo=SloConfig(SLO.ttft_s, SLO.tpot_s))
    return SimConfig(admission=policy)


def text_p99(summary: Summary) -> float | None:
    return next(c.ttft_p99_s for c in summary.classes if c.request_class == "text")


def never_fits_refused(result: SimResult) -> tuple[int, int]:
    """(never-fits requests refused at arrival with no token produced, never-fits total)."""
    recs = [r for r in result.records if r.request_class == "never-fits"]
    refused = [r for r in recs if r.refused is not None and r.first_token_s is None]
    return len(refused), len(recs)


def run_policy(
    admission: str, trace: list[TraceRequest], text_only: list[TraceRequest], hw: StepHardware
) -> tuple[dict, SimResult]:
    config = sim_config(admission)
    t0 = time.perf_counter()
    unloaded = summarize(simulate(text_only, hw, config), SLO)
    result = simulate(trace, hw, config)
    wall = time.perf_counter() - t0
    s = summarize(result, SLO)
    refused, total = never_fits_refused(result)
    base = text_p99(unloaded)
    loaded = text_p99(s)
    burst = next(c for c in s.classes if c.request_class == "4x13-tile")
    missed = Counter(r.request_class for r in result.records if not SLO.met_by(r))
    finished = sum(1 for r in result.records if r.finish_s is not None)
    row = {
        "admission": admission,
        "text_ttft_p99_unloaded_ms": None if base is None else base * 1e3,
        "text_ttft_p99_ms": None if loaded is None else loaded * 1e3,
        "text_ttft_p99_multiple": None if base is None or loaded is None else loaded / base,
        "burst_ttft_p50_ms": None if burst.ttft_p50_s is None else burst.ttft_p50_s * 1e3,
        "burst_ttft_p99_ms": None if burst.ttft_p99_s is None else burst.ttft_p99_s * 1e3,
        "goodput_rps": s.goodput_rps,
        # Goodput if every request that finished had met the SLO: no policy does better.
        "goodput_ceiling_rps": finished / s.duration_s,
        "slo_attainment": s.slo_attainment,
        "slo_missed": dict(sorted(missed.items())),
        "preemptions": s.num_preemptions,
        "recomputed_tokens": s.num_recomputed_tokens,
        "peak_kv": s.peak_kv_occupancy,
        "hangs": int(s.hang),
        "lost": s.num_lost,
        "never_fits_refused": f"{refused}/{total}",
        "sim_wall_s": wall,
    }
    detail = {"summary": dataclasses.asdict(s), "unloaded_text": dataclasses.asdict(unloaded)}
    return row | {"detail": detail}, result


def workload_bound(
    workload: Workload, trace: list[TraceRequest], fcfs: SimResult, hw: StepHardware
) -> dict:
    """The goodput no policy can pass on `trace` (benchmarks/serving/goodput_bound.py),
    and for comparison only (no bound, see there) the most burst requests FCFS or lumpy
    serve within the SLO with the text traffic removed."""
    finishes = {r.request_id for r in fcfs.records if r.refused is None}
    bursts: dict[float, list[TraceRequest]] = {}
    for r in trace:
        if r.request_class == "4x13-tile":
            start = max(s for s in workload.burst_starts if s <= r.arrival_s)
            bursts.setdefault(start, []).append(r)
    bound = goodput_bound(trace, list(bursts.values()), SLO.ttft_s, hw, finishes)
    alone = [r for r in trace if r.request_class == "4x13-tile"]
    alone_met = max(
        sum(SLO.met_by(r) for r in simulate(alone, hw, sim_config(a)).records) for a in policies()
    )
    return dataclasses.asdict(bound) | {"burst_alone_best_met_not_a_bound": alone_met}


def run_workload(workload: Workload, hw: StepHardware, seed: int) -> tuple[dict, dict]:
    """Both policies on one workload: its JSON section and the runs (for the plot)."""
    trace = workload.trace(seed)
    text_only = [r for r in trace if r.request_class == "text"]
    rows, runs = [], {}
    for admission in policies():
        row, runs[admission] = run_policy(admission, trace, text_only, hw)
        rows.append(row)
    fcfs = rows[0]
    bound = workload_bound(workload, trace, runs["fcfs"], hw)
    for row in rows:
        row["goodput_vs_fcfs"] = row["goodput_rps"] / fcfs["goodput_rps"]
        row["goodput_ceiling_vs_fcfs"] = row["goodput_ceiling_rps"] / fcfs["goodput_rps"]
        row["goodput_bound_vs_fcfs"] = bound["goodput_rps"] / fcfs["goodput_rps"]
    checks = {}
    if "lumpy" in runs:
        by_policy = {row["admission"]: row for row in rows}
        lumpy = by_policy["lumpy"]
        # The target where a policy can reach it at all; else the computed bound.
        goal = min(TARGET_GOODPUT_RATIO, lumpy["goodput_bound_vs_fcfs"])
        checks = {
            "text_p99_within_2x_unloaded": lumpy["text_ttft_p99_multiple"]
            <= TARGET_TEXT_P99_MULTIPLE,
            "goodput_at_least_min(1.3x_fcfs,bound)": lumpy["goodput_vs_fcfs"] >= goal,
            # Planning against the SLO, no class pays for another's gain (without
            # targets lumpy trades a burst request or two for hundreds of text ones).
            "lumpy+slo_each_class_met_at_least_fcfs": all(
                by_policy["lumpy+slo"]["slo_missed"].get(cls, 0) <= fcfs["slo_missed"].get(cls, 0)
                for cls in {*fcfs["slo_missed"], *by_policy["lumpy+slo"]["slo_missed"]}
            ),
        }
    checks |= {
        f"{row['admission']}_no_hang_no_loss_never_fits_refused": row["hangs"] == 0
        and row["lost"] == 0
        and row["never_fits_refused"] == f"{NUM_NEVER_FITS}/{NUM_NEVER_FITS}"
        for row in rows
    }
    section = {
        "workload": workload.name,
        "goodput_bound": bound,
        "burst_starts_s": workload.burst_starts,
        "num_text": len(text_only),
        "num_burst_requests": NUM_BURST * workload.num_bursts,
        "rows": rows,
        "checks": checks,
    }
    return section, runs


def plot(path, runs: dict[str, dict[str, SimResult]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = {w.name: w for w in WORKLOADS}
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 4 * len(runs)), squeeze=False)
    fig.suptitle(title, fontsize=9)
    for (name, by_policy), (kv_ax, q_ax) in zip(runs.items(), axes, strict=True):
        for policy, result in by_policy.items():
            ts = [t for t, _, _ in result.timeline]
            kv_ax.plot(ts, [100 * f for _, f, _ in result.timeline], label=policy, lw=0.8)
            q_ax.plot(ts, [q for _, _, q in result.timeline], label=policy, lw=0.8)
        for ax, ylabel in ((kv_ax, "KV blocks in use (%)"), (q_ax, "requests waiting")):
            for start in workloads[name].burst_starts:
                ax.axvline(start, ls="--", lw=0.8, color="gray")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("simulated time (s)")
            ax.set_ylabel(ylabel)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


COLUMNS = [
    "admission",
    "text_ttft_p99_unloaded_ms",
    "text_ttft_p99_ms",
    "text_ttft_p99_multiple",
    "burst_ttft_p99_ms",
    "goodput_rps",
    "goodput_vs_fcfs",
    "goodput_ceiling_vs_fcfs",
    "goodput_bound_vs_fcfs",
    "slo_attainment",
    "slo_missed",
    "preemptions",
    "hangs",
    "lost",
    "never_fits_refused",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="one seed, shorter mixes")
    parser.add_argument("--only-mixes", action="store_true", help="skip the burst workloads")
    args = parser.parse_args()
    hw = lumpy_mixes.preset_hardware()
    title = (
        f"lumpy admission: {hw.model.name} on {hw.accel.name}, text at {TEXT_RATE:g}/s for "
        f"{DURATION_S:g} s + bursts of {NUM_BURST} 4x13-tile requests "
        f"+ {NUM_NEVER_FITS} never-fits; SLO TTFT {SLO.ttft_s * 1e3:g} ms, "
        f"TPOT {SLO.tpot_s * 1e3:g} ms"
    )
    print(title)
    sections, runs, checks = [], {}, {}
    for workload in () if args.only_mixes else WORKLOADS:
        section, runs[workload.name] = run_workload(workload, hw, args.seed)
        sections.append(section)
        checks |= {f"{workload.name}: {k}": v for k, v in section["checks"].items()}
        counts = f"{section['num_text']:,} text + {section['num_burst_requests']} burst requests"
        print(f"\n{workload.name}: bursts at {workload.burst_starts} s, {counts}")
        print(table(section["rows"], COLUMNS))
    if len(policies()) == 1:
        print("(this scheduler has no lumpy admission yet: FCFS only)")
    mixes = []
    for name, trace in [*lumpy_mixes.mixes(args.quick), lumpy_mixes.independent(args.quick)]:
        section = lumpy_mixes.run_mix(name, trace, hw)
        mixes.append(section)
        checks |= {f"{name}: {k}": v for k, v in section["checks"].items()}
        print(
            f"\n{name}: {section['num_requests']:,} requests ({section['num_image']:,} "
            f"with images), goodput ceiling {section['goodput_ceiling_vs_fcfs']:.2f}x FCFS"
        )
        print(table(section["rows"], lumpy_mixes.COLUMNS))
    print("\nchecks:", ", ".join(f"{k}={'pass' if v else 'FAIL'}" for k, v in checks.items()))
    png = RESULTS / "lumpy_admission.png"  # only the burst workloads are plotted
    RESULTS.mkdir(parents=True, exist_ok=True)
    if runs:
        plot(png, runs, title)
    # A partial run (--quick / --only-mixes) never overwrites the full run's file.
    path = write_result(
        "lumpy_admission"
        + ("_quick" if args.quick else "")
        + ("_mixes" if args.only_mixes else ""),
        {
            "title": title,
            "scenario": {
                "accelerator": hw.accel.name,
                "model": hw.model.name,
                "encoder": hw.encoder.name,
                "text_rate": TEXT_RATE,
                "duration_s": DURATION_S,
                "num_burst": NUM_BURST,
                "burst_window_s": BURST_WINDOW_S,
                "burst_period_s": BURST_PERIOD_S,
                "num_never_fits": NUM_NEVER_FITS,
                "slo": dataclasses.asdict(SLO),
                "sim_config": dataclasses.asdict(SimConfig()),
                # The lumpy rows run SchedulerConfig's defaults (headroom, prefill cap, …).
                "scheduler_config": dataclasses.asdict(SchedulerConfig()),
                "seed": args.seed,
            },
            "workloads": sections,
            "untuned_mixes": {
                "slo": dataclasses.asdict(lumpy_mixes.SLO),
                "seeds": lumpy_mixes.SEEDS[:1] if args.quick else lumpy_mixes.SEEDS,
                "shapes": [dataclasses.asdict(s) for s in lumpy_mixes.SHAPES],
                "quick": args.quick,
                "mixes": mixes,
            },
            "checks": checks,
        },
    )
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()

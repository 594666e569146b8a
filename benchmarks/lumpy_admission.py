"""Lumpy admission: steady text chat plus a burst of 4-image 13-tile requests, simulated.

The trace simulator (search/trace_sim.py) drives the real scheduler on the cost model's
clock: H100 preset, MHA-7B backbone, SigLIP So400m tower (§17: one 13-tile image is
2,370 tokens and 1.24 GB of KV, so the burst needs more KV than the card has). FCFS with
a watermark is the baseline; the lumpy policy runs in the same process on the same trace
when this checkout's scheduler has it. Per policy: the text requests' p99 TTFT against
their unloaded value (the same text traffic without the burst), goodput under the SLO,
preemptions, recomputed tokens, hangs, lost requests, never-fits refused at arrival.

    python -m benchmarks.lumpy_admission   # → benchmarks/results/lumpy_admission.{json,png}
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from benchmarks.common import RESULTS, table, write_result
from scheduler.config import SchedulerConfig
from search.capacity import Slo, Summary, summarize
from search.presets import get_accelerator, get_encoder, get_model
from search.step_time import StepHardware
from search.trace_sim import SimConfig, SimResult, simulate
from search.traces import TraceRequest, lumpy_trace

TEXT_RATE = 10.0  # text chat requests per second
DURATION_S = 180.0
BURST_AT_S = 60.0
# 4 images × 13 tiles ≈ 9,500 tokens each: 40 of them ≈ 3.2× the KV pool (7,534 blocks
# of 16), so the burst hurts under any policy. At 10 text req/s FCFS already meets most
# of the SLO, so goodput can rise at most to the arrival rate: ~1.2× here, not 1.3×.
NUM_BURST = 40
BURST_WINDOW_S = 2.0
NUM_NEVER_FITS = 2
SLO = Slo(ttft_s=1.0, tpot_s=0.1)
TARGET_TEXT_P99_MULTIPLE = 2.0
TARGET_GOODPUT_RATIO = 1.3


def policies() -> list[str]:
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    return ["fcfs", "lumpy"] if "admission" in fields else ["fcfs"]


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
    config = SimConfig(admission=admission)
    t0 = time.perf_counter()
    unloaded = summarize(simulate(text_only, hw, config), SLO)
    result = simulate(trace, hw, config)
    wall = time.perf_counter() - t0
    s = summarize(result, SLO)
    refused, total = never_fits_refused(result)
    base = text_p99(unloaded)
    loaded = text_p99(s)
    burst = next(c for c in s.classes if c.request_class == "4x13-tile")
    row = {
        "admission": admission,
        "text_ttft_p99_unloaded_ms": None if base is None else base * 1e3,
        "text_ttft_p99_ms": None if loaded is None else loaded * 1e3,
        "text_ttft_p99_multiple": None if base is None or loaded is None else loaded / base,
        "burst_ttft_p99_ms": None if burst.ttft_p99_s is None else burst.ttft_p99_s * 1e3,
        "goodput_rps": s.goodput_rps,
        "slo_attainment": s.slo_attainment,
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


def plot(path, runs: dict[str, SimResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kv_ax, q_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    fig.suptitle(title, fontsize=9)
    for name, result in runs.items():
        ts = [t for t, _, _ in result.timeline]
        kv_ax.plot(ts, [100 * f for _, f, _ in result.timeline], label=name, lw=0.8)
        q_ax.plot(ts, [q for _, _, q in result.timeline], label=name, lw=0.8)
    for ax, ylabel in ((kv_ax, "KV blocks in use (%)"), (q_ax, "requests waiting")):
        ax.axvline(BURST_AT_S, ls="--", lw=0.8, color="gray")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    hw = StepHardware(
        get_model("mha-7b"), get_encoder("siglip-so400m-14-384"), get_accelerator("h100")
    )
    trace = lumpy_trace(
        TEXT_RATE, DURATION_S, BURST_AT_S, NUM_BURST, BURST_WINDOW_S, args.seed, NUM_NEVER_FITS
    )
    text_only = [r for r in trace if r.request_class == "text"]
    rows, runs = [], {}
    for admission in policies():
        row, runs[admission] = run_policy(admission, trace, text_only, hw)
        rows.append(row)
    fcfs = rows[0]
    for row in rows:
        row["goodput_vs_fcfs"] = row["goodput_rps"] / fcfs["goodput_rps"]
    title = (
        f"lumpy admission: {hw.model.name} on {hw.accel.name}, {len(text_only):,} text "
        f"requests at {TEXT_RATE:g}/s + {NUM_BURST} 4x13-tile at t={BURST_AT_S:g}s "
        f"+ {NUM_NEVER_FITS} never-fits; SLO TTFT {SLO.ttft_s * 1e3:g} ms, "
        f"TPOT {SLO.tpot_s * 1e3:g} ms"
    )
    columns = [
        "admission",
        "text_ttft_p99_unloaded_ms",
        "text_ttft_p99_ms",
        "text_ttft_p99_multiple",
        "burst_ttft_p99_ms",
        "goodput_rps",
        "goodput_vs_fcfs",
        "slo_attainment",
        "preemptions",
        "recomputed_tokens",
        "hangs",
        "lost",
        "never_fits_refused",
    ]
    print(title)
    print(table(rows, columns))
    checks = {}
    if "lumpy" in runs:
        lumpy = rows[-1]
        checks = {
            "text_p99_within_2x_unloaded": lumpy["text_ttft_p99_multiple"]
            <= TARGET_TEXT_P99_MULTIPLE,
            "goodput_at_least_1.3x_fcfs": lumpy["goodput_vs_fcfs"] >= TARGET_GOODPUT_RATIO,
        }
    checks |= {
        f"{row['admission']}_no_hang_no_loss_never_fits_refused": row["hangs"] == 0
        and row["lost"] == 0
        and row["never_fits_refused"] == f"{NUM_NEVER_FITS}/{NUM_NEVER_FITS}"
        for row in rows
    }
    if len(rows) == 1:
        print("(this scheduler has no lumpy admission yet: FCFS only)")
    print("checks:", ", ".join(f"{k}={'pass' if v else 'FAIL'}" for k, v in checks.items()))
    png = RESULTS / "lumpy_admission.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(png, runs, title)
    path = write_result(
        "lumpy_admission",
        {
            "title": title,
            "scenario": {
                "accelerator": hw.accel.name,
                "model": hw.model.name,
                "encoder": hw.encoder.name,
                "text_rate": TEXT_RATE,
                "duration_s": DURATION_S,
                "burst_at_s": BURST_AT_S,
                "num_burst": NUM_BURST,
                "burst_window_s": BURST_WINDOW_S,
                "num_never_fits": NUM_NEVER_FITS,
                "num_text": len(text_only),
                "slo": dataclasses.asdict(SLO),
                "sim_config": dataclasses.asdict(SimConfig()),
                # The lumpy row runs SchedulerConfig's defaults (headroom, prefill cap, …).
                "scheduler_config": dataclasses.asdict(SchedulerConfig()),
                "seed": args.seed,
            },
            "rows": rows,
            "checks": checks,
        },
    )
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()

"""Lumpy admission on held-out seeds (issue 32): lumpy_mixes' four shapes drawn from seeds
fixed before any run and never used to tune the policy (`HELDOUT_SEEDS`), FCFS and lumpy
side by side per class. lumpy_admission's own seeds (101, 202, 32) were looked at while
the policy was built; these were not.

Per mix: text and image requests that met the SLO under each policy. Over all mixes: how
many mixes lumpy's attainment is below FCFS's, per class. For every request FCFS serves
within the SLO and lumpy does not (a lost request), its story under lumpy: when it was
ready and started, its TTFT under both policies, which later arrivals started before it
(passed it), which earlier ones started while it waited, and what was running when it
became ready.

    python -m benchmarks.serving.lumpy_heldout   # → benchmarks/results/lumpy_heldout.json
    python -m benchmarks.serving.lumpy_heldout --seeds 303 --shapes img30-lognormal-bursts
        # a subset → lumpy_heldout_subset.json (the full run's file is kept)
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

from benchmarks.lib.common import table, write_result
from benchmarks.serving import lumpy_mixes
from scheduler.config import SchedulerConfig
from search.sim.capacity import Slo
from search.sim.shaped_traces import shaped_trace
from search.sim.step_time import StepHardware
from search.sim.trace_sim import RequestRecord, SimConfig, SimResult

# Fixed before the first run of this program; never changed to make a mix pass.
HELDOUT_SEEDS = (303, 404, 505, 606, 707, 808, 909, 1010)
CLASSES = ("text", "image")
MAX_LISTED = 8  # requests listed per story field (all are counted)


def _cls(rec: RequestRecord) -> str:
    return "image" if rec.num_images else "text"


def _brief(rec: RequestRecord) -> dict:
    return {
        "id": rec.request_id,
        "class": _cls(rec),
        "arrival_s": round(rec.arrival_s, 4),
        "start_s": None if rec.start_s is None else round(rec.start_s, 4),
        "prompt_tokens": rec.num_prompt_tokens,
        "max_tokens": rec.max_tokens,
    }


def _listed(records: list[RequestRecord]) -> dict:
    return {
        "count": len(records),
        "by_class": dict(Counter(_cls(r) for r in records)),
        "prompt_tokens": sum(r.num_prompt_tokens for r in records),
        "first": [_brief(r) for r in records[:MAX_LISTED]],
    }


def story(rec: RequestRecord, fcfs: RequestRecord, records: list[RequestRecord], slo: Slo) -> dict:
    """What happened under lumpy to `rec`, a request FCFS (`fcfs`: its record there)
    served within `slo`: what it waited for and who went first."""
    ready = rec.ready_s if rec.ready_s is not None else rec.arrival_s
    start = rec.start_s if rec.start_s is not None else float("inf")
    started = sorted(
        (
            r
            for r in records
            if r is not rec and r.start_s is not None and ready <= r.start_s < start
        ),
        key=lambda r: r.start_s or 0.0,
    )
    running = [
        r for r in records
        if r.start_s is not None and r.start_s < ready and (r.finish_s or float("inf")) > ready
    ]  # fmt: skip
    ttft, tpot = rec.ttft_s, rec.tpot_s
    return {
        **_brief(rec),
        "ready_s": round(ready, 4),
        "waited_s": None if rec.start_s is None else round(start - ready, 4),
        "ttft_s": {"fcfs": fcfs.ttft_s, "lumpy": ttft},
        "tpot_s": {"fcfs": fcfs.tpot_s, "lumpy": tpot},
        "missed_on": "ttft" if ttft is None or ttft > slo.ttft_s else "tpot",
        "fcfs_start_s": fcfs.start_s,
        # Later arrivals that started while it waited: the policy let them pass.
        "passed_by": _listed([r for r in started if r.arrival_s > rec.arrival_s]),
        # Earlier arrivals that started while it waited: ahead of it in any order.
        "waited_behind": _listed([r for r in started if r.arrival_s <= rec.arrival_s]),
        "running_when_ready": _listed(running),
    }


def lost_requests(fcfs: SimResult, lumpy: SimResult, slo: Slo) -> list[dict]:
    """Requests FCFS serves within `slo` and lumpy does not, each with its `story`."""
    by_id = {r.request_id: r for r in fcfs.records}
    return [
        story(rec, by_id[rec.request_id], lumpy.records, slo)
        for rec in sorted(lumpy.records, key=lambda r: r.arrival_s)
        if slo.met_by(by_id[rec.request_id]) and not slo.met_by(rec)
    ]


def run_heldout_mix(shape_name: str, seed: int, hw: StepHardware) -> dict:
    shape = next(s for s in lumpy_mixes.SHAPES if s.name == shape_name)
    trace = shaped_trace(shape, seed)
    (fcfs, fcfs_run), (lumpy, lumpy_run) = (
        lumpy_mixes.run_policy(a, trace, hw) for a in ("fcfs", "lumpy")
    )
    section = lumpy_mixes.compare(f"{shape_name}/seed{seed}", trace, fcfs, lumpy)
    slo = lumpy_mixes.SLO
    section["shape"], section["seed"] = shape_name, seed
    section["lost"] = lost_requests(fcfs_run, lumpy_run, slo)
    # The reverse: met under lumpy, missed under FCFS (by class).
    by_id = {r.request_id: r for r in lumpy_run.records}
    section["gained_by_class"] = dict(
        Counter(_cls(r) for r in fcfs_run.records if not slo.met_by(r)
                and slo.met_by(by_id[r.request_id]))
    )  # fmt: skip
    return section


def summary_row(section: dict) -> dict:
    fcfs, lumpy = section["rows"]
    row = {"mix": section["mix"]}
    for cls in CLASSES:
        row[f"{cls}_fcfs"], row[f"{cls}_lumpy"] = fcfs[f"{cls}_met"], lumpy[f"{cls}_met"]
    row["goodput_vs_fcfs"] = lumpy["goodput_vs_fcfs"]
    row["lost"] = ",".join(s["id"] for s in section["lost"]) or "-"
    row["gained"] = sum(section["gained_by_class"].values())
    row["hangs/lost"] = f"{fcfs['hangs'] + lumpy['hangs']}/{fcfs['lost'] + lumpy['lost']}"
    return row


def totals(sections: list[dict]) -> dict:
    """Mixes where lumpy's attainment is below FCFS's, per class, and the requests lost."""
    out: dict = {}
    for cls in CLASSES:
        below = [s["mix"] for s in sections if not s["checks"][f"{cls}_attainment_at_least_fcfs"]]
        out[f"{cls}_mixes_below_fcfs"] = below
        out[f"{cls}_requests_lost"] = sum(
            1 for s in sections for x in s["lost"] if x["class"] == cls
        )
        out[f"{cls}_requests_gained"] = sum(s["gained_by_class"].get(cls, 0) for s in sections)
    out["num_mixes"] = len(sections)
    out["hangs_or_lost_or_never_fits_admitted"] = [
        s["mix"] for s in sections if not s["checks"]["no_hang_no_loss_never_fits_refused"]
    ]
    return out


def print_story(mix: str, s: dict) -> None:
    ttft = s["ttft_s"]
    print(
        f"  {mix} {s['id']} ({s['class']}, {s['prompt_tokens']} prompt tokens, max "
        f"{s['max_tokens']}): ready {s['ready_s']:.3f} s, started {s['start_s']} "
        f"(FCFS {s['fcfs_start_s']:.3f}), waited {s['waited_s']} s; TTFT FCFS "
        f"{ttft['fcfs']:.3f} s, lumpy {ttft['lumpy']}; missed on {s['missed_on']}"
    )
    for key in ("passed_by", "waited_behind", "running_when_ready"):
        x = s[key]
        ids = " ".join(f"{b['id']}({b['class'][0]})" for b in x["first"])
        print(f"    {key}: {x['count']} {x['by_class']} {x['prompt_tokens']} tokens: {ids}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=list(HELDOUT_SEEDS))
    names = [s.name for s in lumpy_mixes.SHAPES]
    parser.add_argument("--shapes", nargs="*", choices=names, default=names)
    args = parser.parse_args()
    hw = lumpy_mixes.preset_hardware()
    slo = lumpy_mixes.SLO
    print(
        f"lumpy admission, held-out seeds {args.seeds}: {hw.model.name} on {hw.accel.name}, "
        f"SLO TTFT {slo.ttft_s * 1e3:g} ms, TPOT {slo.tpot_s * 1e3:g} ms"
    )
    sections = []
    for shape_name in args.shapes:
        for seed in args.seeds:
            section = run_heldout_mix(shape_name, seed, hw)
            sections.append(section)
            row = summary_row(section)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)  # progress
    rows = [summary_row(s) for s in sections]
    print("\n" + table(rows, list(rows[0])))
    print("\nlost requests (met under FCFS, missed under lumpy):")
    for s in sections:
        for lost in s["lost"]:
            print_story(s["mix"], lost)
    summary = totals(sections)
    print("\n", summary)
    full = set(args.seeds) == set(HELDOUT_SEEDS) and len(args.shapes) == len(names)
    path = write_result(
        "lumpy_heldout" if full else "lumpy_heldout_subset",
        {
            "title": f"lumpy admission on held-out seeds {args.seeds}",
            "scenario": {
                "accelerator": hw.accel.name,
                "model": hw.model.name,
                "encoder": hw.encoder.name,
                "slo": dataclasses.asdict(slo),
                "seeds": args.seeds,
                "shapes": [
                    dataclasses.asdict(s) for s in lumpy_mixes.SHAPES if s.name in args.shapes
                ],  # fmt: skip
                "sim_config": dataclasses.asdict(SimConfig()),
                "scheduler_config": dataclasses.asdict(SchedulerConfig()),
            },
            "summary": summary,
            "table": rows,
            "mixes": sections,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

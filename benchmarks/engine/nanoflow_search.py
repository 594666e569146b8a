"""The auto-search on the reference's own inputs (NanoFlow §4.1.4) and on this CPU:
what structure it chooses, the Stage I / Stage II makespans against the layer run in
order (and, `cyclic`, the period of the layer pipeline, layer after layer), the shares,
and how long each CBC solve took. 70B is searched under both partitionings of the
attention half's collectives (op_graph.PARTITIONINGS); the faster is the search's pick.
The reference's 70B structure (4 nano-operations over KQV, attention and the collective
after it, 2 over the rest) is also solved with its counts forced, from the searched
schedule cut to them, for comparison. Writes benchmarks/results/nanoflow_search.json.

    .venv/bin/python -m benchmarks.engine.nanoflow_search [--time-limit 30] [--skip-cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.lib.common import table, write_result
from search.costmodel.presets import ModelShape, get_accelerator, get_model
from search.nanoflow.auto_search import search_schedule
from search.nanoflow.milp import solve_stage1, split_groups
from search.nanoflow.milp_stage2 import solve_stage2
from search.nanoflow.nano_schedule import split_largest
from search.nanoflow.op_graph import PARTITIONINGS
from search.nanoflow.profiles import Profiles, synthetic_gpu_profiles
from vlmserve.worker.nano_profile import measure_cpu_profiles

# NanoFlow's 70B pipeline (Fig. 6; its pipeline.cu): 4 nano-operations over KQV, decode
# attention and the collective after it, 2 over the rest.
REFERENCE_4WAY = {
    "allreduce": ("qkv", "attention", "o_proj", "allreduce_attn"),
    "allgather": ("qkv", "attention", "allgather_attn"),
}
CPU_MODEL = ModelShape("tiny-cpu-gqa", 2, 256, 8, 2, 32, 768, 1000)


def _summary(
    name: str, profiles: Profiles, dense_batch: int, limit: float, cyclic: bool = False
) -> dict:
    schedule = search_schedule(profiles, dense_batch, limit, cyclic=cyclic)
    n = schedule.notes
    shares = {
        f"{op.op}[{op.row_start}:{op.row_end}]": round(op.share, 2)
        for op in schedule.nano_ops
        if op.share < 1
    }
    return {
        "case": name,
        "cyclic": cyclic,
        "partitioning": n["partitioning"],
        "counts": n["counts"],
        "sequential_us": round(schedule.sequential_us, 1),
        # Cyclic: the period (a layer every so many us); else one layer's makespan.
        "stage1_us": round(n["stage1_period_us"] or n["stage1_makespan_us"], 1),
        "stage2_us": round(n["searched_makespan_us"] if not cyclic else _period(schedule, n), 1),
        "overlap_pays": n["overlap_pays"],
        "rounds": n["rounds"],
        "stage2_solve_s": round(n["stage2_solve_s"], 2),
        "search_s": round(n["search_s"], 1),
        "shares": shares,
    }


def _period(schedule, notes: dict) -> float:
    # A cyclic search whose overlap does not pay emits the unsplit layer: period = layer.
    return notes["period_us"] if notes["period_us"] is not None else schedule.sequential_us


def _reference_structure(profiles: Profiles, limit: float, cyclic: bool = False) -> dict:
    """Stage I with NanoFlow's 70B counts, warm-started from the two-way optimum."""
    partitioning = profiles.notes["partitioning"]
    four = REFERENCE_4WAY[partitioning]
    group = split_groups(p.op for p in profiles.ops)
    order = {p.op: i for i, p in enumerate(profiles.ops)}
    two = solve_stage1(profiles, 2048, {g: 2 for g in set(group.values())}, limit, cyclic=cyclic)
    counts = {g: 4 if g in four else 2 for g in set(group.values())}
    incumbent = two.nanos
    for g in four:
        members = {o for o, grp in group.items() if grp == g}
        for _ in range(2):
            incumbent = split_largest(incumbent, members, 128, profiles.time_us, order)
    forced = solve_stage1(profiles, 2048, counts, limit, incumbent, cyclic)
    stage2 = solve_stage2(forced, profiles, limit)
    return {
        "case": f"llama-2-70b tp8 {partitioning}, reference counts forced"
        + (", cyclic" if cyclic else ""),
        "counts": counts,
        "stage1_us": round(forced.cost_us, 1),
        "stage1_status": forced.status,
        "stage1_solve_s": round(forced.solve_s, 1),
        "stage2_us": round(stage2.cost_us, 1),
        "two_way_stage1_us": round(two.cost_us, 1),
    }


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args(argv)
    a100 = get_accelerator("a100")
    cases, chosen, forced = [], {}, []
    for model, tp in (("llama-2-70b", 8), ("llama-3-8b", 1)):
        for cyclic in (False, True):
            options = []
            for part in PARTITIONINGS if tp > 1 else ("allreduce",):
                profiles = synthetic_gpu_profiles(
                    get_model(model), a100, 2048, tp, partitioning=part
                )
                name = f"{model} tp{tp} a100 (synthetic){f', {part}' if tp > 1 else ''}"
                options.append(_summary(name + (", cyclic" if cyclic else ""), profiles,
                                        2048, args.time_limit, cyclic))  # fmt: skip
                if tp > 1:
                    forced.append(_reference_structure(profiles, args.time_limit, cyclic))
            cases += options
            # NanoFlow's operation transformations: the faster partitioning is the search's.
            best = min(options, key=lambda c: c["stage2_us"])
            chosen[f"{model}{', cyclic' if cyclic else ''}"] = best["partitioning"]
    cpu = None
    if not args.skip_cpu:
        t0 = time.perf_counter()
        profiles = measure_cpu_profiles(CPU_MODEL, 256)
        profile_s = time.perf_counter() - t0
        cpu = _summary("tiny GQA layer on this CPU (measured)", profiles, 256, args.time_limit)
        cpu |= {"profile_s": round(profile_s, 1)}
        cpu |= {"interference": profiles.interference, "raw": profiles.notes["interference"]}
        cases.append(cpu)
    rows = [
        {k: c[k] for k in ("case", "sequential_us", "stage1_us", "stage2_us", "overlap_pays")}
        | {"split": ",".join(f"{g}{n}" for g, n in c["counts"].items())}
        for c in cases
    ]
    print(table(rows, ["case", "split", "sequential_us", "stage1_us", "stage2_us", "overlap_pays"]))
    for f in forced:
        print(f"{f['case']}: {f}")
    print(f"partitioning chosen: {chosen}")
    print(f"load average {os.getloadavg()} (2 shared cores: solve times are upper bounds)")
    result = {
        "time_limit_s": args.time_limit,
        "load_average": os.getloadavg(),
        "cases": cases,
        "partitioning_chosen": chosen,
        "reference_structure_70b": forced,
    }
    write_result("nanoflow_search", result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

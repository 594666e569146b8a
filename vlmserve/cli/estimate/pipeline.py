"""``vlmserve estimate pipeline``: NanoFlow's auto-search (§4.1) for one model and device.

On a GPU preset the profiles are synthetic (the cost model's per-op times and Table 3);
with ``--accelerator cpu`` one layer of the model is timed on this CPU (a small model:
give a checkpoint's config.json). Profiles and the schedule are cached as JSON under
``--cache-dir``; the schedule is what the runner executes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from search.costmodel.presets import get_accelerator, get_model
from search.nanoflow.auto_search import best_partitioning, cached_schedule, search_schedule
from search.nanoflow.op_graph import PARTITIONINGS, BatchMix
from search.nanoflow.profiles import (
    DEFAULT_CACHE_DIR,
    Profiles,
    save_profiles,
    synthetic_gpu_profiles,
    try_load_profiles,
)
from search.nanoflow.schedule import Schedule


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dense-batch",
        type=int,
        help="tokens per step, a multiple of 128 (GPU) or 16 (cpu); default 2048 / 256",
    )
    p.add_argument(
        "--decode-fraction",
        type=float,
        default=0.5,
        help="share of the batch's rows that decode (default: %(default)s)",
    )
    p.add_argument(
        "--decode-context",
        type=int,
        help="decode rows' context (default: their caches fill the device; 512 on cpu)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=20.0,
        help="seconds CBC may take per MILP solve (default: %(default)s)",
    )
    p.add_argument(
        "--cyclic",
        action="store_true",
        help="minimise the period of the layer pipeline (layer l+1's head beside layer l's "
        "tail) instead of one layer's makespan",
    )
    p.add_argument(
        "--partitioning",
        choices=(*PARTITIONINGS, "best"),
        default="best",
        help="under --tp > 1, the attention half's collectives: an all-reduce after O, "
        "all-gathers either side of O, or the faster of the two searched (default)",
    )
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="profiles and schedules")
    p.add_argument("--refresh", action="store_true", help="search (and profile) again")


def _profile_sets(args: argparse.Namespace, mix: BatchMix, dense_batch: int) -> list[Profiles]:
    """One profile set per partitioning to search: both for `best` under TP on a GPU (on
    one device the two are one graph)."""
    if args.partitioning != "best":
        parts: tuple[str, ...] = (args.partitioning,)
    elif args.tp > 1 and args.accelerator.strip().lower() != "cpu":
        parts = PARTITIONINGS
    else:
        parts = ("allreduce",)
    return [_profiles(args, mix, dense_batch, p) for p in parts]


def _profiles(
    args: argparse.Namespace, mix: BatchMix, dense_batch: int, partitioning: str
) -> Profiles:
    model = get_model(args.model)
    cache_dir = Path(args.cache_dir)
    if args.accelerator.strip().lower() == "cpu":
        if args.tp != 1:
            raise ValueError("--tp must be 1 on cpu")
        cached = None if args.refresh else try_load_profiles(cache_dir, model.name, "cpu")
        if cached is not None and cached.max_tokens >= dense_batch:
            return cached
        from vlmserve.worker.nano_profile import measure_cpu_profiles

        profiles = measure_cpu_profiles(model, dense_batch, mix)
    else:
        accel = get_accelerator(args.accelerator)
        profiles = synthetic_gpu_profiles(
            model, accel, dense_batch, args.tp, mix, partitioning=partitioning
        )
    save_profiles(profiles, cache_dir)
    return profiles


def _table(schedule: Schedule, from_cache: bool) -> str:
    n = schedule.notes
    saving = 1 - schedule.makespan_us / schedule.sequential_us
    counts = ", ".join(f"{op} {c}" for op, c in n["counts"].items())
    lines = [
        f"pipeline: {schedule.model} on {schedule.device}, dense batch {schedule.dense_batch}"
        f" ({n['profiles']} profiles{', cached' if from_cache else ''})",
        f"  nano-operations   {counts}",
        *(
            [
                f"  partitioning      {n['partitioning']} (searched: "
                + ", ".join(f"{p} {c:,.1f} us" for p, c in costs.items())
                + ")"
            ]
            if (costs := n.get("partitioning_costs_us"))
            else []
        ),  # fmt: skip
        f"  layer, in order   {schedule.sequential_us:,.1f} us",
        f"  Stage I           {n['stage1_makespan_us']:,.1f} us (no interference)",
        f"  Stage II          {n['searched_makespan_us']:,.1f} us (R -> P interference)",
        f"  chosen            {schedule.makespan_us:,.1f} us ({saving:.1%} shorter; "
        f"overlap {'pays' if n['overlap_pays'] else 'does NOT pay: run in order'})",
        *(
            [
                f"  period            {period:,.1f} us a layer, layer after layer "
                f"({1 - period / schedule.sequential_us:.1%} shorter; Stage I "
                f"{n['stage1_period_us']:,.1f} us)"
            ]
            if (period := n.get("period_us")) is not None
            else []
        ),  # fmt: skip
        "  solves            "
        + ", ".join(f"{r['solve_s']:.1f} s ({r['status']})" for r in n["rounds"])
        + f"; Stage II {n['stage2_solve_s']:.1f} s",
        "",
        f"  {'stream':<8} {'op':<15} {'rows':>11} {'start us':>10} {'dur us':>9} {'R':>5}",
    ]
    for op in schedule.nano_ops:
        rows = f"{op.row_start}:{op.row_end}"
        lines.append(
            f"  {op.resource:<8} {op.op:<15} {rows:>11} {op.start_us:>10.1f} "
            f"{op.duration_us:>9.1f} {op.share:>5.2f}"
        )
    return "\n".join(lines)


def _search(
    args: argparse.Namespace, profiles: Profiles, dense_batch: int
) -> tuple[Schedule, bool]:
    """The schedule for `profiles` and whether it came from the cache."""
    if args.refresh:
        return search_schedule(profiles, dense_batch, args.time_limit, cyclic=args.cyclic), False
    return cached_schedule(
        profiles, dense_batch, Path(args.cache_dir), args.time_limit, args.cyclic
    )


def run_pipeline(args: argparse.Namespace) -> int:
    """Profile (or load), search (or load), print; user errors exit 2 with one line."""
    try:
        plot = Path(args.plot) if args.plot else None
        if plot is not None and (plot.suffix.lower() != ".png" or not plot.parent.is_dir()):
            raise ValueError(f"--plot wants a .png file in an existing folder, got {args.plot}")
        if args.kv_dtype != "bf16":
            raise ValueError("pipeline prices a bf16 cache only")
        on_cpu = args.accelerator.strip().lower() == "cpu"
        dense_batch = args.dense_batch or (256 if on_cpu else 2048)
        if args.time_limit <= 0:
            raise ValueError(f"--time-limit must be > 0, got {args.time_limit}")
        mix = BatchMix(
            args.decode_fraction,
            args.decode_context or (512 if on_cpu else None),
            workspace_bytes=args.workspace_gb * 1e9,
        )
        found = [
            _search(args, profiles, dense_batch)
            for profiles in _profile_sets(args, mix, dense_batch)
        ]
        schedule = best_partitioning([s for s, _ in found]) if len(found) > 1 else found[0][0]
        hit = all(h for _, h in found)
        if plot is not None:
            from vlmserve.cli.estimate.plot import draw_gantt

            draw_gantt(plot, schedule)
    except (ValueError, OSError) as exc:
        print(f"vlmserve estimate pipeline: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"command": "pipeline", "cached": hit, **asdict(schedule)}, indent=1))
    else:
        print(_table(schedule, hit))
    if plot is not None:
        print(f"wrote {plot}", file=sys.stderr)
    return 0

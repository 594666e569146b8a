"""The auto-search (NanoFlow §4.1): iterative Stage I splitting, then Stage II shares,
emitted as the `Schedule` the runner executes and cached per (model, device, B_dense).

Stage I starts with every op cut into two nano-operations. After each solve the largest
compute bubble (an interval in which no compute-bound nano-operation runs) is found and
the ops near it (those running during it, and the compute ops either side) get one more
nano-operation each; the new split is kept if the layer got shorter. When one more does
not help, twice as many are tried (each nano-batch of those ops halved): a bubble that
three resources chain into can need four nano-operations where three are no better than
two (NanoFlow's 70B pipeline: 4 over KQV and attention). The search stops when neither
shortens the layer, or when a nano-operation would fall under the profiling granularity.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from search.nanoflow.milp import StageResult, solve_stage1, split_groups
from search.nanoflow.milp_stage2 import solve_stage2
from search.nanoflow.nano_schedule import Nano, split_largest
from search.nanoflow.profiles import Profiles, _slug
from search.nanoflow.schedule import NanoOp, Schedule, check

STREAMS = {"compute": 0, "memory": 1, "network": 2}
MIN_GAIN = 1e-3  # a split must shorten the layer by 0.1% to be kept


@dataclass(frozen=True)
class Bubble:
    start_us: float
    end_us: float

    @property
    def length_us(self) -> float:
        return self.end_us - self.start_us


def compute_bubbles(nanos: tuple[Nano, ...], period: float | None = None) -> list[Bubble]:
    """Idle intervals of the compute stream between its first and last nano-operation,
    longest first: where a compute op waits on another resource. (Before the first and
    after the last no compute op is left that could run: those are not bubbles.) With a
    `period` (a cyclic schedule) the compute stream is a circle: its nano-operations
    taken modulo the period, and the gap across the period's end is one too."""
    busy = sorted(
        (n.start_us, n.start_us + n.duration_us) for n in nanos if n.resource == "compute"
    )
    if period is not None and busy:
        busy = sorted((a % period, a % period + b - a) for a, b in busy)
        busy.append((busy[0][0] + period, busy[0][1] + period))
    gaps, edge = [], busy[0][1] if busy else 0.0
    for a, b in busy[1:]:
        if a > edge + 1e-6:
            gaps.append(Bubble(edge, a))
        edge = max(edge, b)
    return sorted(gaps, key=lambda g: -g.length_us)


def ops_near(bubble: Bubble, nanos: tuple[Nano, ...], period: float | None = None) -> set[str]:
    """Ops running during `bubble`, and the compute ops ending or starting at its edges
    (with a `period`: any layer's copy of them)."""
    near = set()
    # A bubble lies in [0, 2T); a nano-operation's copies at start mod T, one T either side.
    shifts = (0.0,) if period is None else (-period, 0.0, period)
    for n in nanos:
        base = n.start_us if period is None else n.start_us % period
        for start in (base + shift for shift in shifts):
            end = start + n.duration_us
            if start < bubble.end_us - 1e-9 and end > bubble.start_us + 1e-9:
                near.add(n.op)
            elif n.resource == "compute" and (
                abs(end - bubble.start_us) < 1e-6 or abs(start - bubble.end_us) < 1e-6
            ):
                near.add(n.op)
    return near


def stage1_search(
    profiles: Profiles,
    dense_batch: int,
    time_limit_s: float = 20.0,
    max_rounds: int = 8,
    bubbles_per_round: int = 2,
    cyclic: bool = False,
) -> tuple[StageResult, dict[str, int], list[dict]]:
    """Iterative splitting; returns the best Stage I result, its counts and the rounds.
    Each round tries the largest bubbles in turn and keeps the first split that helps.
    `cyclic`: the period of the layer pipeline is what a split must shorten."""
    group = split_groups(p.op for p in profiles.ops)
    order = {p.op: i for i, p in enumerate(profiles.ops)}
    granules = dense_batch // profiles.granularity
    counts = {g: min(2, granules) for g in sorted(set(group.values()))}
    best = solve_stage1(profiles, dense_batch, counts, time_limit_s, cyclic=cyclic)
    rounds = [_round(counts, best, kept=True)]
    for _ in range(max_rounds):
        improved = False
        for bubble in compute_bubbles(best.nanos, best.period_us)[:bubbles_per_round]:
            near = {group[o] for o in ops_near(bubble, best.nanos, best.period_us)}
            one_more = {g: n + (g in near) for g, n in counts.items()}
            doubled = {g: n * (1 + (g in near)) for g, n in counts.items()}
            for trial_counts in [one_more] + [doubled] * (doubled != one_more):
                incumbent = _split(best.nanos, near, trial_counts, counts, group, profiles, order)
                if incumbent is None:  # a nano-batch would fall under the granularity
                    continue
                trial = solve_stage1(
                    profiles, dense_batch, trial_counts, time_limit_s, incumbent, cyclic
                )
                kept = trial.cost_us < best.cost_us * (1 - MIN_GAIN)
                rounds.append(_round(trial_counts, trial, kept))
                if kept:
                    best, counts, improved = trial, trial_counts, True
                    break
            if improved:
                break
        if not improved:
            break
    return best, counts, rounds


def _split(
    nanos: tuple[Nano, ...],
    near: set[str],
    new_counts: dict[str, int],
    counts: dict[str, int],
    group: dict[str, str],
    profiles: Profiles,
    order: dict[str, int],
) -> tuple[Nano, ...] | None:
    """A warm start with `new_counts`: `nanos` with each near group's widest nano-batch cut
    in two until it has its new count; None if one would fall under the granularity."""
    incumbent: tuple[Nano, ...] | None = nanos
    for g in sorted(near):
        members = {o for o, grp in group.items() if grp == g}
        for _ in range(new_counts[g] - counts[g]):
            if incumbent is None:
                return None
            incumbent = split_largest(
                incumbent, members, profiles.granularity, profiles.time_us, order
            )
    return incumbent


def _round(counts: dict[str, int], result: StageResult, kept: bool) -> dict:
    return {
        "counts": dict(counts),
        "makespan_us": round(result.makespan_us, 3),
        "period_us": None if result.period_us is None else round(result.period_us, 3),
        "status": result.status,
        "solve_s": round(result.solve_s, 3),
        "kept": kept,
    }


def search_schedule(
    profiles: Profiles,
    dense_batch: int,
    time_limit_s: float = 20.0,
    max_rounds: int = 8,
    interference: bool = True,
    cyclic: bool = False,
) -> Schedule:
    """Stage I (iterated) then, with `interference`, Stage II; checked before returning.
    `cyclic`: both stages minimise the period of the layer pipeline (layer l + 1's head
    may run beside layer l's tail; notes["period_us"]) instead of one layer's makespan."""
    t0 = time.perf_counter()
    stage1, counts, rounds = stage1_search(
        profiles, dense_batch, time_limit_s, max_rounds, cyclic=cyclic
    )
    final = solve_stage2(stage1, profiles, time_limit_s) if interference else stage1
    sequential = sum(profiles.time_us(p.op, dense_batch) for p in profiles.ops)
    # Overlap that does not beat the unsplit layer run op after op is not worth its
    # weight re-reads: emit that layer instead (is_split False: the runner goes in order).
    pays = final.cost_us < sequential * (1 - MIN_GAIN)
    nanos = final.nanos if pays else _unsplit(profiles, dense_batch)
    schedule = Schedule(
        model=profiles.model,
        device=profiles.device,
        dense_batch=dense_batch,
        nano_ops=tuple(
            NanoOp(
                n.op,
                n.row_start,
                n.row_end,
                n.resource,  # type: ignore[arg-type]
                STREAMS[n.resource],
                n.start_us,
                n.duration_us,
                n.share,
            )
            for n in sorted(nanos, key=lambda n: (n.start_us, STREAMS[n.resource]))
        ),
        sequential_us=sequential,
        notes={
            "overlap_pays": pays,
            "cyclic": cyclic,
            "period_us": final.period_us if pays else None,
            "stage1_period_us": stage1.period_us,
            "stage2_period_us": final.period_us if interference else None,
            "searched_makespan_us": final.makespan_us,
            "counts": counts,
            "rounds": rounds,
            "stage1_makespan_us": stage1.makespan_us,
            "stage2_makespan_us": final.makespan_us if interference else None,
            "stage2_status": final.status if interference else None,
            "stage2_solve_s": final.solve_s if interference else None,
            "search_s": time.perf_counter() - t0,
            "profiles": profiles.source,
            "partitioning": profiles.notes.get("partitioning", "allreduce"),
            "granularity": profiles.granularity,
        },
    )
    problems = check(schedule)
    assert not problems, f"the search emitted an invalid schedule: {problems[:3]}"
    return schedule


def schedule_cost_us(schedule: Schedule) -> float:
    """What a search minimised, as emitted: the period of a cyclic schedule whose overlap
    pays, else one layer's makespan (the unsplit layer's when it does not pay)."""
    period = schedule.notes.get("period_us")
    return period if period is not None else schedule.makespan_us


def best_partitioning(schedules: list[Schedule]) -> Schedule:
    """NanoFlow's operation transformations (§4.1.2) as options: of one layer searched
    under each partitioning of its collectives (op_graph.PARTITIONINGS, one profile set
    each), the fastest; its notes name every option's cost."""
    costs = {s.notes["partitioning"]: round(schedule_cost_us(s), 3) for s in schedules}
    best = min(schedules, key=schedule_cost_us)
    best.notes["partitioning_costs_us"] = costs
    return best


def _unsplit(profiles: Profiles, dense_batch: int) -> tuple[Nano, ...]:
    nanos, clock = [], 0.0
    for p in profiles.ops:
        d = profiles.time_us(p.op, dense_batch)
        nanos.append(Nano(p.op, 0, 0, dense_batch, p.resource, d, clock, d))
        clock += d
    return tuple(nanos)


def schedule_path(
    cache_dir: Path, model: str, device: str, dense_batch: int, cyclic: bool = False
) -> Path:
    kind = "-cyclic" if cyclic else ""
    return cache_dir / f"schedule-{_slug(model)}-{_slug(device)}-b{dense_batch}{kind}.json"


def cached_schedule(
    profiles: Profiles,
    dense_batch: int,
    cache_dir: Path,
    time_limit_s: float = 20.0,
    cyclic: bool = False,
) -> tuple[Schedule, bool]:
    """The cached schedule for these profiles and batch, or a fresh search saved there;
    the flag says whether it came from the cache. A cached schedule whose profiles differ
    from `profiles` (re-profiled since) is searched again."""
    path = schedule_path(cache_dir, profiles.model, profiles.device, dense_batch, cyclic)
    if path.is_file():
        cached = Schedule.load(path)
        if cached.notes.get("profile_digest") == _digest(profiles):
            return cached, True
    schedule = search_schedule(profiles, dense_batch, time_limit_s, cyclic=cyclic)
    schedule.notes["profile_digest"] = _digest(profiles)
    schedule.save(path)
    return schedule, False


def _digest(profiles: Profiles) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(asdict(profiles), sort_keys=True).encode()).hexdigest()[:16]

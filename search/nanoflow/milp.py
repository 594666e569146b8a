"""NanoFlow's two auto-search MILPs (§4.1.2, §4.1.3) in pulp, solved with CBC: Stage I here,
Stage II in search/nanoflow/milp_stage2.py.

Stage I (no interference): how many nano-operations each op is cut into is given; the
MILP picks their sizes (multiples of the profiling granularity summing to B_dense), and
start times, minimising the layer's makespan. A nano-operation depends on one of the op
before it iff their row ranges intersect, which is itself decided by the sizes, so it is
modelled with two binaries per pair ("my rows are all below yours" / "all above"); two
nano-operations of one bound resource never overlap (a binary ordering per pair). All
big-M constants come from the profiles: a row bound of B_dense / granularity, and a time
bound of one feasible schedule (the even split run op after op), which no optimum
exceeds. Resource-load cuts (the layer lasts at least each resource's total) and a
greedy or previous-round incumbent make the branch and bound prune early.

Stage II (interference): sizes and per-resource order fixed from Stage I, each
nano-operation gets a share R of the device with Σ R ≤ 1 over nano-operations running at
once, and takes T = D_best / P(R) (P from the R → P table). Overlap of two nano-operations
of different resources is a binary choice (ordered one way, the other way, or
overlapping under the Σ R ≤ 1 cut); three nano-operations overlapping pairwise share a
common instant (intervals on a line), so a cut per pair and per triple is exact.
T ≥ D/P(R) is convex in R for a concave P and is bounded below by its secants.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import combinations

try:
    import pulp
except ModuleNotFoundError:  # only the solves need it: the CLI and engine import this module
    pulp = None

from search.nanoflow.nano_schedule import (
    Nano,
    asap,
    data_edges,
    even_split,
    list_schedule,
    makespan,
    precedence,
)
from search.nanoflow.profiles import Profiles

# Elementwise ops take the split of the GEMM they feed or follow (NanoFlow fuses them
# into it), so the search decides one split per GEMM, attention and collective.
FUSED_INTO: dict[str, str] = {
    "input_norm": "qkv",
    "rope_kv_write": "qkv",
    "post_norm": "gate_up",
    "silu_mul": "gate_up",
}
MIN_SHARE = 0.1  # Stage II's floor on R: below it D/P(R) grows without bound
SHARE_GRID = tuple(round(0.1 * i, 1) for i in range(1, 11))


@dataclass(frozen=True)
class StageResult:
    nanos: tuple[Nano, ...]
    makespan_us: float  # after `asap` on the exact durations
    status: str  # "optimal", or "time limit": CBC's best when the limit cut it short
    solve_s: float
    period_us: float | None = None  # cyclic: one layer every period_us (see solve_stage1)

    @property
    def cost_us(self) -> float:
        """What the solve minimised: the period when cyclic, else the layer's makespan."""
        return self.makespan_us if self.period_us is None else self.period_us


def split_groups(op_names: Iterable[str]) -> dict[str, str]:
    """op -> the op whose split it takes (itself unless fused into a present GEMM)."""
    names = list(op_names)
    return {o: FUSED_INTO[o] if FUSED_INTO.get(o) in names else o for o in names}


def _require_pulp() -> None:
    if pulp is None:
        raise ModuleNotFoundError("the NanoFlow MILP search needs pulp: pip install pulp")


def _cbc(time_limit_s: float, warm: bool = False) -> pulp.LpSolver:
    # One thread: the search shares the host with the engine (and CI with other jobs).
    with warnings.catch_warnings():
        # pulp 3.3 deprecates the CBC binary it ships in favour of pulp[cbc]; it still
        # runs it, and that binary is the one this project can count on.
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1, warmStart=warm)


# --- Stage I ---------------------------------------------------------------------------


def solve_stage1(
    profiles: Profiles,
    dense_batch: int,
    counts: dict[str, int],
    time_limit_s: float = 20.0,
    incumbent: tuple[Nano, ...] | None = None,
    cyclic: bool = False,
) -> StageResult:
    """Sizes and start times for `counts` nano-operations per split group, no interference.
    `incumbent`: a valid schedule with these counts to start the branch and bound from.

    `cyclic`: the layer repeats every `period` µs, as the decoder runs layer after layer,
    and the period is minimised instead of one layer's makespan. The next layer's first
    op may start on the rows whose last op has ended while this layer's other rows still
    run (NanoFlow's pipeline: KQV of layer l + 1 behind the all-reduce of layer l), and a
    resource runs one nano-operation at a time across layers: modulo the period. At most
    two layers are in flight (makespan <= 2 periods)."""
    _require_pulp()
    g = profiles.granularity
    if dense_batch % g or not g <= dense_batch <= profiles.max_tokens:
        raise ValueError(f"dense batch {dense_batch} is not a profiled multiple of {g}")
    granules = dense_batch // g
    names = [p.op for p in profiles.ops]
    order = {o: i for i, o in enumerate(names)}
    group = split_groups(names)
    for grp in set(group.values()):
        if not 1 <= counts[grp] <= granules:
            raise ValueError(f"{grp}: {counts[grp]} nano-operations of >= {g} rows each")
    best = {o: [profiles.time_us(o, m * g) for m in range(1, granules + 1)] for o in names}
    resource = {p.op: p.resource for p in profiles.ops}

    prob = pulp.LpProblem("nanoflow_stage1", pulp.LpMinimize)
    x, size, lo = {}, {}, {}
    for grp in sorted(set(group.values())):
        n = counts[grp]
        for k in range(n):
            for m in range(1, granules - n + 2):
                x[grp, k, m] = prob.add_variable(f"x_{grp}_{k}_{m}", cat="Binary")
            sizes = [m for (gg, kk, m) in x if gg == grp and kk == k]
            prob += pulp.lpSum(x[grp, k, m] for m in sizes) == 1
            size[grp, k] = pulp.lpSum(m * x[grp, k, m] for m in sizes)
        prob += pulp.lpSum(size[grp, k] for k in range(n)) == granules
        for k in range(n):
            lo[grp, k] = pulp.lpSum(size[grp, j] for j in range(k))
    # Time big-M: the makespan of one feasible schedule (even sizes, one nano-operation
    # after another) bounds the optimum's, so no start or end in it lies beyond.
    # With `cyclic` that schedule, repeated, is a pipeline of that period, so the period
    # is below it and the makespan below twice it; the big-M spans every difference of
    # two starts, a period and two laps.
    horizon = sum(best[o][m - 1] for o in names for m in even_split(granules, counts[group[o]]))
    last_start, big = (2 * horizon, 6 * horizon) if cyclic else (horizon, horizon)
    start, dur = {}, {}
    for o in names:
        grp = group[o]
        for k in range(counts[grp]):
            start[o, k] = prob.add_variable(f"s_{o}_{k}", 0, last_start)
            dur[o, k] = pulp.lpSum(
                best[o][m - 1] * x[grp, k, m] for (gg, kk, m) in x if (gg, kk) == (grp, k)
            )
    span = prob.add_variable("makespan", 0, last_start)
    period = prob.add_variable("period", 0, horizon) if cyclic else None
    # Cyclic: the period first; of the schedules with the best period, the shortest layer.
    prob += span if period is None else period + 1e-3 * span
    cost = span if period is None else period
    for (o, k), s in start.items():
        prob += span >= s + dur[o, k]
        if k:  # an op's nano-operations run in row order on its stream
            prob += s >= start[o, k - 1] + dur[o, k - 1]
    # Valid cuts the disjunctions hide from the LP relaxation: a resource runs its
    # nano-operations one at a time, so the layer (or the period) lasts at least each
    # resource's load.
    for res in set(resource.values()):
        prob += cost >= pulp.lpSum(d for (o, _), d in dur.items() if resource[o] == res)
    row_vars: dict = {}
    for p, o in zip(names, names[1:], strict=False):
        row_vars |= _stage1_dependency(
            prob, p, o, group, counts, start, dur, size, lo, granules, big
        )
    if period is None:
        order_vars = _one_at_a_time(prob, start, dur, resource, group, big)
    else:
        prob += span <= 2 * period
        # Row 0 and the last row each go through every op once a layer: two cycles of
        # dependencies the period cannot be shorter than.
        prob += period >= pulp.lpSum(dur[o, 0] for o in names)
        prob += period >= pulp.lpSum(dur[o, counts[group[o]] - 1] for o in names)
        row_vars |= _stage1_dependency(
            prob, names[-1], names[0], group, counts, start, dur, size, lo, granules, big, period
        )
        order_vars = _one_at_a_time_modulo(prob, start, dur, resource, group, period, big)
    _warm_start(
        profiles, dense_batch, counts, incumbent, x, start, span, order_vars, row_vars, period
    )
    status, solve_s = _solve(prob, time_limit_s, "Stage I found no schedule", warm=True)
    nanos = []
    for o in names:
        grp = group[o]
        edge = 0
        for k in range(counts[grp]):
            rows = round(pulp.value(size[grp, k])) * g
            d = profiles.time_us(o, rows)
            nanos.append(Nano(o, k, edge, edge + rows, resource[o], d, pulp.value(start[o, k]), d))
            edge += rows
    if period is None:
        nanos = asap(nanos, precedence(nanos, order))
        return StageResult(tuple(nanos), makespan(nanos), status, solve_s)
    laps = {
        pair: next(m for m, v in ys.items() if pulp.value(v) > 0.5)
        for pair, ys in order_vars.items()
    }
    nanos, period_us = periodic_asap(nanos, order, laps, pulp.value(period))
    return StageResult(tuple(nanos), makespan(nanos), status, solve_s, period_us)


def _one_at_a_time(prob, start, dur, resource, group, big) -> dict:
    """Two nano-operations of one bound resource never overlap: an order binary a pair."""
    order_vars = {}
    for a, b in combinations(list(start), 2):
        if a[0] != b[0] and resource[a[0]] == resource[b[0]]:
            if group[a[0]] == group[b[0]] and a[1] == b[1]:
                continue  # the same rows, so ordered through the chain between them
            z = order_vars[a, b] = prob.add_variable(f"z_{a[0]}_{a[1]}_{b[0]}_{b[1]}", cat="Binary")
            prob += start[b] >= start[a] + dur[a] - big * (1 - z)
            prob += start[a] >= start[b] + dur[b] - big * z
    return order_vars


def _one_at_a_time_modulo(prob, start, dur, resource, group, period, big) -> dict:
    """Two nano-operations of one resource never overlap in any pair of layers: b's copy
    m layers later starts after a ends and ends before a's copy one layer later starts,
    for one lap m per pair, {(a, b): {m: binary}}. With starts in [0, 2T) the lap is one
    of -1..2; a pair the chain orders (same op, or same rows of one split) has -1 or 0:
    `start`'s keys come in layer order, an op's in row order, so a runs before b."""
    laps = {}
    for a, b in combinations(list(start), 2):
        if resource[a[0]] != resource[b[0]]:
            continue
        chained = a[0] == b[0] or (group[a[0]] == group[b[0]] and a[1] == b[1])
        choices = (-1, 0) if chained else (-1, 0, 1, 2)
        ys = laps[a, b] = {
            m: prob.add_variable(f"lap_{a[0]}_{a[1]}_{b[0]}_{b[1]}_{m + 1}", cat="Binary")
            for m in choices
        }
        prob += pulp.lpSum(ys.values()) == 1
        for m, y in ys.items():
            prob += start[b] + m * period >= start[a] + dur[a] - big * (1 - y)
            prob += start[a] + period >= start[b] + m * period + dur[b] - big * (1 - y)
    return laps


def lap_of(a: Nano, b: Nano, period: float, eps: float = 1e-6) -> int | None:
    """The lap m at which b's copies clear a's (see `_one_at_a_time_modulo`): b's copy m
    layers later starts within one period after a starts, and it has to start after a
    ends and end before a's next copy starts. None if the two overlap in some pair of
    layers."""
    lap = -math.floor((b.start_us - a.start_us) / period)
    for m in (lap, lap - 1):  # lap - 1: an offset a hair under T that rounding made
        offset = b.start_us + m * period - a.start_us
        if a.duration_us - eps <= offset <= period - b.duration_us + eps:
            return m
    return None


def periodic_asap(
    nanos: list[Nano], order: dict[str, int], laps: dict, period: float
) -> tuple[list[Nano], float]:
    """Every nano-operation as early as its dependencies (this layer's and, for the first
    op, the previous layer's last op) and its resource's lap choices allow at `period`,
    by longest paths (Bellman-Ford); `period` is raised by the solver's rounding until
    those constraints have no positive cycle. Makes the cyclic schedule valid exactly."""
    index = {(n.op, n.index): i for i, n in enumerate(nanos)}
    edges = _layer_edges(nanos, order)
    for (ka, kb), m in laps.items():
        a, b = index[ka], index[kb]
        edges.append((a, b, nanos[a].duration_us, m))  # s_b >= s_a + d_a - m T
        edges.append((b, a, nanos[b].duration_us, 1 - m))  # s_a >= s_b + d_b - (1 - m) T
    for _ in range(60):
        starts = _longest_paths(len(nanos), edges, period)
        if starts is not None:
            out = [replace(n, start_us=s) for n, s in zip(nanos, starts, strict=True)]
            return out, period
        period = period * (1 + 1e-9) + 1e-6
    raise RuntimeError("the cyclic schedule's constraints have a positive cycle")


def _layer_edges(nanos: list[Nano], order: dict[str, int]) -> list[tuple[int, int, float, int]]:
    """(i, j, d_i, lag): j starts after i ends, j `lag` layers later. This layer's data
    dependencies, an op's nano-operations in row order, and the next layer's first op
    after this layer's last on the rows both touch."""
    edges = [(i, j, nanos[i].duration_us, 0) for i, j in data_edges(nanos, order)]
    chain = sorted(order, key=order.get)
    for i, a in enumerate(nanos):
        for j, b in enumerate(nanos):
            rows = a.row_start < b.row_end and b.row_start < a.row_end
            if a.op == chain[-1] and b.op == chain[0] and rows:
                edges.append((i, j, a.duration_us, 1))
            if a.op == b.op and b.index == a.index + 1:
                edges.append((i, j, a.duration_us, 0))
    return edges


def _longest_paths(n: int, edges: list, period: float) -> list[float] | None:
    starts = [0.0] * n
    for _ in range(n + 1):
        changed = False
        for i, j, w, laps in edges:
            t = starts[i] + w - laps * period
            if t > starts[j] + 1e-12:
                starts[j], changed = t, True
        if not changed:
            return starts
    return None


def _stage1_dependency(prob, p, o, group, counts, start, dur, size, lo, granules, big, lag=0):
    """Nano-operation (o, k) waits for (p, j) iff their row ranges intersect; returns
    the binaries deciding that, {(o, k, p, j): (below, above)}. `lag`: o runs that much
    later than its start says (the next layer's copy: one period)."""
    if group[p] == group[o]:  # same split: only the same rows intersect
        for k in range(counts[group[o]]):
            prob += start[o, k] + lag >= start[p, k] + dur[p, k]
        return {}
    go, gp = group[o], group[p]
    row_vars = {}
    for k in range(counts[go]):
        for j in range(counts[gp]):
            if k == 0 and j == 0:  # both begin at row 0: always intersect
                prob += start[o, k] + lag >= start[p, j] + dur[p, j]
                continue
            below = prob.add_variable(f"below_{o}_{k}_{p}_{j}", cat="Binary")
            above = prob.add_variable(f"above_{o}_{k}_{p}_{j}", cat="Binary")
            row_vars[o, k, p, j] = (below, above)
            prob += below + above <= 1
            # below = 1 only if o's rows end where p's begin or earlier; above mirrors it.
            prob += lo[go, k] + size[go, k] <= lo[gp, j] + granules * (1 - below)
            prob += lo[gp, j] + size[gp, j] <= lo[go, k] + granules * (1 - above)
            prob += start[o, k] + lag >= start[p, j] + dur[p, j] - big * (below + above)
    return row_vars


def _warm_start(
    profiles, dense_batch, counts, incumbent, x, start, span, order_vars, row_vars, period
):
    """Hand CBC a first incumbent: the better of the greedy schedule of the even split and
    `incumbent` (the previous round's best, cut to these counts). Branches worse than a
    known schedule are then cut from the first node. Cyclic: the layer, repeated with its
    makespan as the period, is a pipeline (one layer after another)."""
    g, names = profiles.granularity, [p.op for p in profiles.ops]
    order, group = {o: i for i, o in enumerate(names)}, split_groups(names)
    nanos = []
    for o in names:
        edge = 0
        for k, m in enumerate(even_split(dense_batch // g, counts[group[o]])):
            d = profiles.time_us(o, m * g)
            nanos.append(Nano(o, k, edge, edge + m * g, profiles.op(o).resource, d, 0.0, d))
            edge += m * g
    best = list_schedule(nanos, order)
    if incumbent is not None and makespan(incumbent) < makespan(best):
        best = list(incumbent)
    at = {(n.op, n.index): n for n in best}
    for (grp, k, m), v in x.items():
        first = next(o for o in names if group[o] == grp)
        v.setInitialValue(1 if (at[first, k].row_end - at[first, k].row_start) == m * g else 0)
    for key, v in start.items():
        v.setInitialValue(at[key].start_us)
    span.setInitialValue(makespan(best))
    if period is None:
        for (a, b), z in order_vars.items():
            z.setInitialValue(1 if at[b].start_us >= at[a].start_us + at[a].duration_us else 0)
    else:  # order_vars: each pair's lap binaries
        period.setInitialValue(makespan(best))
        for (a, b), ys in order_vars.items():
            lap = lap_of(at[a], at[b], makespan(best))
            for m, y in ys.items():
                y.setInitialValue(1 if m == lap else 0)
    for (o, k, p, j), (below, above) in row_vars.items():
        below.setInitialValue(1 if at[o, k].row_end <= at[p, j].row_start else 0)
        above.setInitialValue(1 if at[p, j].row_end <= at[o, k].row_start else 0)


def _status(prob: pulp.LpProblem) -> str:
    """ "optimal", or "time limit" when CBC stopped with a schedule it had not proven best."""
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    return "time limit" if prob.sol_status == pulp.LpSolutionIntegerFeasible else "none"


def _solve(prob, time_limit_s: float, failure: str, warm: bool = False) -> tuple[str, float]:
    t0 = time.perf_counter()
    prob.solve(_cbc(time_limit_s, warm))
    solve_s = time.perf_counter() - t0
    status = _status(prob)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise RuntimeError(f"{failure} in {time_limit_s} s ({status})")
    return status, solve_s

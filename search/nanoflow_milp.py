"""NanoFlow's two auto-search MILPs (§4.1.2, §4.1.3) in pulp, solved with CBC.

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

import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import combinations

import pulp

from search.nano_schedule import (
    Nano,
    asap,
    closure,
    even_split,
    list_schedule,
    makespan,
    precedence,
)
from search.profiles import Profiles

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


def split_groups(op_names: Iterable[str]) -> dict[str, str]:
    """op -> the op whose split it takes (itself unless fused into a present GEMM)."""
    names = list(op_names)
    return {o: FUSED_INTO[o] if FUSED_INTO.get(o) in names else o for o in names}


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
) -> StageResult:
    """Sizes and start times for `counts` nano-operations per split group, no interference.
    `incumbent`: a valid schedule with these counts to start the branch and bound from."""
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
    horizon = sum(best[o][m - 1] for o in names for m in even_split(granules, counts[group[o]]))
    start, dur = {}, {}
    for o in names:
        grp = group[o]
        for k in range(counts[grp]):
            start[o, k] = prob.add_variable(f"s_{o}_{k}", 0, horizon)
            dur[o, k] = pulp.lpSum(
                best[o][m - 1] * x[grp, k, m] for (gg, kk, m) in x if (gg, kk) == (grp, k)
            )
    span = prob.add_variable("makespan", 0, horizon)
    prob += span
    for (o, k), s in start.items():
        prob += span >= s + dur[o, k]
        if k:  # an op's nano-operations run in row order on its stream
            prob += s >= start[o, k - 1] + dur[o, k - 1]
    # Valid cuts the disjunctions hide from the LP relaxation: a resource runs its
    # nano-operations one at a time, so the layer lasts at least each resource's load.
    for res in set(resource.values()):
        prob += span >= pulp.lpSum(d for (o, _), d in dur.items() if resource[o] == res)
    row_vars: dict = {}
    for p, o in zip(names, names[1:], strict=False):
        row_vars |= _stage1_dependency(
            prob, p, o, group, counts, start, dur, size, lo, granules, horizon
        )
    # One bound resource runs one nano-operation at a time (no same-resource overlap).
    keys, order_vars = list(start), {}
    for a, b in combinations(keys, 2):
        if a[0] != b[0] and resource[a[0]] == resource[b[0]]:
            if group[a[0]] == group[b[0]] and a[1] == b[1]:
                continue  # the same rows, so ordered through the chain between them
            z = order_vars[a, b] = prob.add_variable(f"z_{a[0]}_{a[1]}_{b[0]}_{b[1]}", cat="Binary")
            prob += start[b] >= start[a] + dur[a] - horizon * (1 - z)
            prob += start[a] >= start[b] + dur[b] - horizon * z
    _warm_start(profiles, dense_batch, counts, incumbent, x, start, span, order_vars, row_vars)
    t0 = time.perf_counter()
    prob.solve(_cbc(time_limit_s, warm=True))
    solve_s = time.perf_counter() - t0
    status = _status(prob)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise RuntimeError(f"Stage I found no schedule in {time_limit_s} s ({status})")
    nanos = []
    for o in names:
        grp = group[o]
        edge = 0
        for k in range(counts[grp]):
            rows = round(pulp.value(size[grp, k])) * g
            d = profiles.time_us(o, rows)
            nanos.append(Nano(o, k, edge, edge + rows, resource[o], d, pulp.value(start[o, k]), d))
            edge += rows
    nanos = asap(nanos, precedence(nanos, order))
    return StageResult(tuple(nanos), makespan(nanos), status, solve_s)


def _stage1_dependency(prob, p, o, group, counts, start, dur, size, lo, granules, horizon):
    """Nano-operation (o, k) waits for (p, j) iff their row ranges intersect; returns
    the binaries deciding that, {(o, k, p, j): (below, above)}."""
    if group[p] == group[o]:  # same split: only the same rows intersect
        for k in range(counts[group[o]]):
            prob += start[o, k] >= start[p, k] + dur[p, k]
        return {}
    go, gp = group[o], group[p]
    row_vars = {}
    for k in range(counts[go]):
        for j in range(counts[gp]):
            if k == 0 and j == 0:  # both begin at row 0: always intersect
                prob += start[o, k] >= start[p, j] + dur[p, j]
                continue
            below = prob.add_variable(f"below_{o}_{k}_{p}_{j}", cat="Binary")
            above = prob.add_variable(f"above_{o}_{k}_{p}_{j}", cat="Binary")
            row_vars[o, k, p, j] = (below, above)
            prob += below + above <= 1
            # below = 1 only if o's rows end where p's begin or earlier; above mirrors it.
            prob += lo[go, k] + size[go, k] <= lo[gp, j] + granules * (1 - below)
            prob += lo[gp, j] + size[gp, j] <= lo[go, k] + granules * (1 - above)
            prob += start[o, k] >= start[p, j] + dur[p, j] - horizon * (below + above)
    return row_vars


def _warm_start(profiles, dense_batch, counts, incumbent, x, start, span, order_vars, row_vars):
    """Hand CBC a first incumbent: the better of the greedy schedule of the even split and
    `incumbent` (the previous round's best, cut to these counts). Branches worse than a
    known schedule are then cut from the first node."""
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
    for (a, b), z in order_vars.items():
        z.setInitialValue(1 if at[b].start_us >= at[a].start_us + at[a].duration_us else 0)
    for (o, k, p, j), (below, above) in row_vars.items():
        below.setInitialValue(1 if at[o, k].row_end <= at[p, j].row_start else 0)
        above.setInitialValue(1 if at[p, j].row_end <= at[o, k].row_start else 0)


def _status(prob: pulp.LpProblem) -> str:
    """ "optimal", or "time limit" when CBC stopped with a schedule it had not proven best."""
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    return "time limit" if prob.sol_status == pulp.LpSolutionIntegerFeasible else "none"


# --- Stage II --------------------------------------------------------------------------


def _secants(profiles: Profiles, resource: str) -> list[tuple[float, float, float, float]]:
    """(R0, 1/P(R0), R1, 1/P(R1)) for consecutive shares from MIN_SHARE to 1."""
    knots = sorted({r for r, _ in profiles.knots(resource) if r >= MIN_SHARE} | set(SHARE_GRID))
    inv = [(r, 1 / profiles.perf(resource, r)) for r in knots]
    return [(r0, v0, r1, v1) for (r0, v0), (r1, v1) in zip(inv, inv[1:], strict=False)]


def solve_stage2(
    stage1: StageResult, profiles: Profiles, time_limit_s: float = 20.0
) -> StageResult:
    """Shares R and interference-adjusted times for Stage I's nano-operations."""
    nanos = list(stage1.nanos)
    order = {p.op: i for i, p in enumerate(profiles.ops)}
    fixed = precedence(nanos, order)
    reach = closure(len(nanos), fixed)
    horizon = sum(n.best_us / profiles.perf(n.resource, MIN_SHARE) for n in nanos)
    prob = pulp.LpProblem("nanoflow_stage2", pulp.LpMinimize)
    idx = range(len(nanos))
    s = [prob.add_variable(f"s_{i}", 0, horizon) for i in idx]
    t = [prob.add_variable(f"t_{i}", nanos[i].best_us, horizon) for i in idx]
    r = [prob.add_variable(f"r_{i}", MIN_SHARE, 1) for i in idx]
    span = prob.add_variable("makespan", 0, horizon)
    # Makespan first; a nano-operation nothing competes with then takes R = 1 (its best
    # time) rather than any share that happens not to lengthen the layer.
    prob += span + 1e-3 * pulp.lpSum(t)
    for i, n in enumerate(nanos):
        prob += span >= s[i] + t[i]
        for r0, v0, r1, v1 in _secants(profiles, n.resource):
            prob += t[i] >= n.best_us * (v0 + (v1 - v0) * (r[i] - r0) / (r1 - r0))
    for i, j in fixed:
        prob += s[j] >= s[i] + t[i]
    # before[i, j] = 1: i ends before j starts. A pair of different resources that no
    # precedence orders may instead overlap, and then shares at most the whole device.
    before = {}
    for i, j in combinations(idx, 2):
        if reach[i][j] or reach[j][i] or nanos[i].resource == nanos[j].resource:
            continue
        for a, b in ((i, j), (j, i)):
            before[a, b] = prob.add_variable(f"b_{a}_{b}", cat="Binary")
            prob += s[b] >= s[a] + t[a] - horizon * (1 - before[a, b])
        prob += before[i, j] + before[j, i] <= 1
        prob += r[i] + r[j] <= 1 + before[i, j] + before[j, i]
    for i, j, k in combinations(idx, 3):
        pairs = ((i, j), (i, k), (j, k))
        if all(p in before for p in pairs):
            apart = pulp.lpSum(before[a, b] + before[b, a] for a, b in pairs)
            prob += r[i] + r[j] + r[k] <= 1 + 2 * apart
    t0 = time.perf_counter()
    prob.solve(_cbc(time_limit_s))
    solve_s = time.perf_counter() - t0
    status = _status(prob)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise RuntimeError(f"Stage II found no allocation in {time_limit_s} s ({status})")
    edges = set(fixed) | {p for p, v in before.items() if pulp.value(v) > 0.5}
    out = []
    for i, n in enumerate(nanos):
        # A share no constraint reads (its resource's P(R) is flat, as measured on a quiet
        # CPU) has no value from CBC: it does not matter, so it is the whole device.
        value = pulp.value(r[i])
        share = 1.0 if value is None else min(1.0, max(MIN_SHARE, value))
        d = n.best_us / profiles.perf(n.resource, share)
        out.append(replace(n, share=share, duration_us=d, start_us=pulp.value(s[i])))
    out = asap(out, edges)
    return StageResult(tuple(out), makespan(out), status, solve_s)

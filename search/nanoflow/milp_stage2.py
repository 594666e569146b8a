"""NanoFlow's Stage II MILP (§4.1.3) in pulp, solved with CBC: the interference stage
(search/nanoflow/milp.py has Stage I and the model's description).

Sizes and per-resource order fixed from Stage I, each nano-operation gets a share R of the
device with Σ R ≤ 1 over nano-operations running at once, and takes T = D_best / P(R);
per layer, or `cyclic` (the period of the layer pipeline).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

from search.nanoflow.milp import (  # pulp: None where it is not installed (see milp.py)
    MIN_SHARE,
    SHARE_GRID,
    StageResult,
    _layer_edges,
    _require_pulp,
    _solve,
    lap_of,
    periodic_asap,
    pulp,
)
from search.nanoflow.nano_schedule import (
    Nano,
    asap,
    closure,
    makespan,
    precedence,
)
from search.nanoflow.profiles import Profiles


def _secants(profiles: Profiles, resource: str) -> list[tuple[float, float, float, float]]:
    """(R0, 1/P(R0), R1, 1/P(R1)) for consecutive shares from MIN_SHARE to 1."""
    knots = sorted({r for r, _ in profiles.knots(resource) if r >= MIN_SHARE} | set(SHARE_GRID))
    inv = [(r, 1 / profiles.perf(resource, r)) for r in knots]
    return [(r0, v0, r1, v1) for (r0, v0), (r1, v1) in zip(inv, inv[1:], strict=False)]


def solve_stage2(
    stage1: StageResult, profiles: Profiles, time_limit_s: float = 20.0
) -> StageResult:
    """Shares R and interference-adjusted times for Stage I's nano-operations (a cyclic
    Stage I gets a cyclic Stage II: see `_solve_stage2_cyclic`)."""
    _require_pulp()
    if stage1.period_us is not None:
        return _solve_stage2_cyclic(stage1, profiles, time_limit_s)
    nanos = list(stage1.nanos)
    order = {p.op: i for i, p in enumerate(profiles.ops)}
    fixed = precedence(nanos, order)
    reach = closure(len(nanos), fixed)
    horizon = sum(n.best_us / profiles.perf(n.resource, MIN_SHARE) for n in nanos)
    prob = pulp.LpProblem("nanoflow_stage2", pulp.LpMinimize)
    s, t, r = _stage2_variables(prob, nanos, profiles, horizon, horizon)
    span = prob.add_variable("makespan", 0, horizon)
    # Makespan first; a nano-operation nothing competes with then takes R = 1 (its best
    # time) rather than any share that happens not to lengthen the layer.
    prob += span + 1e-3 * pulp.lpSum(t)
    for i in range(len(nanos)):
        prob += span >= s[i] + t[i]
    for i, j in fixed:
        prob += s[j] >= s[i] + t[i]
    # before[i, j] = 1: i ends before j starts. A pair of different resources that no
    # precedence orders may instead overlap, and then shares at most the whole device.
    before = {}
    for i, j in combinations(range(len(nanos)), 2):
        if reach[i][j] or reach[j][i] or nanos[i].resource == nanos[j].resource:
            continue
        for a, b in ((i, j), (j, i)):
            before[a, b] = prob.add_variable(f"b_{a}_{b}", cat="Binary")
            prob += s[b] >= s[a] + t[a] - horizon * (1 - before[a, b])
        prob += before[i, j] + before[j, i] <= 1
        prob += r[i] + r[j] <= 1 + before[i, j] + before[j, i]
    apart: dict[tuple[int, int], list] = {}
    for (a, b), v in before.items():  # both orders of a pair keep it apart
        apart.setdefault((min(a, b), max(a, b)), []).append(v)
    _triple_cuts(prob, r, apart)
    status, solve_s = _solve(prob, time_limit_s, "Stage II found no allocation")
    edges = set(fixed) | {p for p, v in before.items() if pulp.value(v) > 0.5}
    out = asap(_shared(nanos, s, r, profiles), edges)
    return StageResult(tuple(out), makespan(out), status, solve_s)


def _solve_stage2_cyclic(
    stage1: StageResult, profiles: Profiles, time_limit_s: float
) -> StageResult:
    """Stage II over the layer pipeline: the period is minimised; each resource keeps
    Stage I's order across layers (its laps), and a pair of different resources either
    clears at some lap (as one resource's pairs do) or overlaps somewhere and shares
    the device (R_i + R_j <= 1; and <= 1 over three that pairwise overlap: on a circle
    three such need not share an instant, so there the cut is safe but may cost time)."""
    nanos = list(stage1.nanos)
    order = {p.op: i for i, p in enumerate(profiles.ops)}
    key = [(n.op, n.index) for n in nanos]
    horizon = sum(n.best_us / profiles.perf(n.resource, MIN_SHARE) for n in nanos)
    big = 6 * horizon
    prob = pulp.LpProblem("nanoflow_stage2_cyclic", pulp.LpMinimize)
    s, t, r = _stage2_variables(prob, nanos, profiles, horizon, 2 * horizon)
    span = prob.add_variable("makespan", 0, 2 * horizon)
    period = prob.add_variable("period", 0, horizon)
    prob += period + 1e-3 * pulp.lpSum(t)
    prob += span <= 2 * period
    for i, j, _, lag in _layer_edges(nanos, order):
        prob += s[j] >= s[i] + t[i] - lag * period
    for i in range(len(nanos)):
        prob += span >= s[i] + t[i]
    laps, apart = {}, {}
    for i, j in combinations(range(len(nanos)), 2):
        if nanos[i].resource == nanos[j].resource:
            m = lap_of(nanos[i], nanos[j], stage1.period_us)
            laps[key[i], key[j]] = m
            prob += s[j] + m * period >= s[i] + t[i]
            prob += s[i] + period >= s[j] + m * period + t[j]
            continue
        ys = apart[i, j] = {
            m: prob.add_variable(f"y_{i}_{j}_{m + 1}", cat="Binary") for m in (-1, 0, 1, 2)
        }
        prob += pulp.lpSum(ys.values()) <= 1
        for m, y in ys.items():
            prob += s[j] + m * period >= s[i] + t[i] - big * (1 - y)
            prob += s[i] + period >= s[j] + m * period + t[j] - big * (1 - y)
        prob += r[i] + r[j] <= 1 + pulp.lpSum(ys.values())
    _triple_cuts(prob, r, {p: list(ys.values()) for p, ys in apart.items()})
    status, solve_s = _solve(prob, time_limit_s, "cyclic Stage II found no allocation")
    for (i, j), ys in apart.items():
        lap = next((m for m, y in ys.items() if pulp.value(y) > 0.5), None)
        if lap is not None:
            laps[key[i], key[j]] = lap
    out, period_us = periodic_asap(_shared(nanos, s, r, profiles), order, laps, pulp.value(period))
    return StageResult(tuple(out), makespan(out), status, solve_s, period_us)


def _stage2_variables(prob, nanos, profiles, horizon, last_start):
    """Start, time and share per nano-operation, time bounded below by D_best / P(R)."""
    idx = range(len(nanos))
    s = [prob.add_variable(f"s_{i}", 0, last_start) for i in idx]
    t = [prob.add_variable(f"t_{i}", nanos[i].best_us, horizon) for i in idx]
    r = [prob.add_variable(f"r_{i}", MIN_SHARE, 1) for i in idx]
    for i, n in enumerate(nanos):
        for r0, v0, r1, v1 in _secants(profiles, n.resource):
            prob += t[i] >= n.best_us * (v0 + (v1 - v0) * (r[i] - r0) / (r1 - r0))
    return s, t, r


def _triple_cuts(prob, r, apart: dict) -> None:
    """R_i + R_j + R_k <= 1 where all three may overlap pairwise; `apart[(i, j)]`, i < j:
    the binaries that keep the pair apart (only pairs that may overlap are keys)."""
    for i, j, k in combinations(sorted({x for pair in apart for x in pair}), 3):
        pairs = ((i, j), (i, k), (j, k))
        if all(p in apart for p in pairs):
            kept = pulp.lpSum(v for p in pairs for v in apart[p])
            prob += r[i] + r[j] + r[k] <= 1 + 2 * kept


def _shared(nanos, s, r, profiles) -> list[Nano]:
    out = []
    for i, n in enumerate(nanos):
        # A share no constraint reads (its resource's P(R) is flat, as measured on a quiet
        # CPU) has no value from CBC: it does not matter, so it is the whole device.
        value = pulp.value(r[i])
        share = 1.0 if value is None else min(1.0, max(MIN_SHARE, value))
        d = n.best_us / profiles.perf(n.resource, share)
        out.append(replace(n, share=share, duration_us=d, start_us=pulp.value(s[i])))
    return out

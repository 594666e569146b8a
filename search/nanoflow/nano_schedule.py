"""Nano-operations and the arithmetic of their schedules, shared by both MILPs and the
auto-search: dependencies by row intersection, ASAP timing, a greedy list schedule (the
MILPs' first incumbent), and cutting a nano-operation in two.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Nano:
    """One nano-operation as the MILPs see it (rows in tokens, times in microseconds)."""

    op: str
    index: int  # k-th nano-operation of its op, in row order
    row_start: int
    row_end: int
    resource: str
    best_us: float  # D_best at its size
    start_us: float
    duration_us: float
    share: float = 1.0


def depends(later: Nano, earlier: Nano, order: dict[str, int]) -> bool:
    rows = later.row_start < earlier.row_end and earlier.row_start < later.row_end
    return rows and order[later.op] > order[earlier.op]


def asap(nanos: list[Nano], edges: set[tuple[int, int]]) -> list[Nano]:
    """Every nano-operation started as soon as all of `edges`' predecessors (i, j): i
    before j) have ended; keeps the Stage's order, removes the solver's slack and
    rounding, and so makes the schedule valid exactly."""
    preds: dict[int, list[int]] = {j: [] for j in range(len(nanos))}
    for i, j in edges:
        preds[j].append(i)
    end: dict[int, float] = {}
    out = list(nanos)
    pending = list(range(len(nanos)))
    while pending:
        ready = [j for j in pending if all(i in end for i in preds[j])]
        assert ready, "precedence edges form a cycle"
        for j in ready:
            start = max((end[i] for i in preds[j]), default=0.0)
            out[j] = replace(nanos[j], start_us=start)
            end[j] = start + nanos[j].duration_us
            pending.remove(j)
    return out


def data_edges(nanos: list[Nano], order: dict[str, int]) -> set[tuple[int, int]]:
    """(i, j): j needs i's output (consecutive ops, intersecting rows). The rest of the
    dependencies follow through the chain: every op tiles all rows."""
    chain = sorted(order, key=order.get)
    next_op = dict(zip(chain, chain[1:], strict=False))
    return {
        (i, j)
        for i, a in enumerate(nanos)
        for j, b in enumerate(nanos)
        if next_op.get(a.op) == b.op and depends(b, a, order)
    }


def list_schedule(nanos: list[Nano], order: dict[str, int]) -> list[Nano]:
    """A greedy schedule (Stage I's first incumbent): repeatedly start the ready
    nano-operation that can start earliest on its resource."""
    preds: dict[int, list[int]] = {j: [] for j in range(len(nanos))}
    for i, j in data_edges(nanos, order):
        preds[j].append(i)
    end: dict[int, float] = {}
    free: dict[str, float] = {}
    out = list(nanos)
    while len(end) < len(nanos):
        ready = [j for j in range(len(nanos)) if j not in end and all(i in end for i in preds[j])]
        earliest = {
            j: max([free.get(nanos[j].resource, 0.0)] + [end[i] for i in preds[j]]) for j in ready
        }
        j = min(ready, key=lambda j: (earliest[j], order[nanos[j].op], nanos[j].index))
        out[j] = replace(nanos[j], start_us=earliest[j])
        end[j] = free[nanos[j].resource] = earliest[j] + nanos[j].duration_us
    return out


def precedence(nanos: list[Nano], order: dict[str, int]) -> set[tuple[int, int]]:
    """Data dependencies between consecutive ops, and each resource's order by start."""
    edges = data_edges(nanos, order)
    by_resource: dict[str, list[int]] = {}
    for i, n in enumerate(nanos):
        by_resource.setdefault(n.resource, []).append(i)
    for members in by_resource.values():
        members.sort(key=lambda i: (nanos[i].start_us, order[nanos[i].op], nanos[i].index))
        edges.update(zip(members, members[1:], strict=False))
    return edges


def closure(n: int, edges: set[tuple[int, int]]) -> list[list[bool]]:
    """reach[i][j]: j cannot start before i ends, through any chain of edges."""
    succ: dict[int, list[int]] = {i: [] for i in range(n)}
    for i, j in edges:
        succ[i].append(j)
    reach = [[False] * n for _ in range(n)]
    for i in range(n):
        stack = list(succ[i])
        while stack:
            j = stack.pop()
            if not reach[i][j]:
                reach[i][j] = True
                stack.extend(succ[j])
    return reach


def even_split(granules: int, n: int) -> list[int]:
    return [granules // n + (1 if k < granules % n else 0) for k in range(n)]


def makespan(nanos: Iterable[Nano]) -> float:
    return max(n.start_us + n.duration_us for n in nanos)


def split_largest(
    nanos: tuple[Nano, ...], ops: set[str], granularity: int, time_us, order: dict[str, int]
) -> tuple[Nano, ...] | None:
    """`nanos` with the largest nano-batch of `ops` (ops sharing one split) cut in two
    halves run back to back, re-timed ASAP in the same per-resource order: a valid
    schedule with one more nano-operation per op in `ops`; None if none can be cut.
    `time_us(op, rows)` is D_best."""
    mine = [n for n in nanos if n.op in ops]
    widest = max(mine, key=lambda n: n.row_end - n.row_start)
    rows = widest.row_end - widest.row_start
    if rows < 2 * granularity:
        return None
    cut = widest.row_start + (rows // granularity // 2) * granularity
    out: list[Nano] = []
    for n in nanos:
        if n.op not in ops or (n.row_start, n.row_end) != (widest.row_start, widest.row_end):
            shift = int(n.op in ops and n.row_start >= widest.row_end)
            out.append(replace(n, index=n.index + shift))
            continue
        first = replace(
            n, row_end=cut, best_us=time_us(n.op, cut - n.row_start), start_us=n.start_us
        )
        first = replace(first, duration_us=first.best_us)
        d = time_us(n.op, n.row_end - cut)
        second = replace(
            n,
            index=n.index + 1,
            row_start=cut,
            best_us=d,
            duration_us=d,
            start_us=n.start_us + first.duration_us,
        )
        out += [first, second]
    return tuple(asap(out, precedence(out, order)))

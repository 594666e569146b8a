"""The nano-batch schedule: what the auto-search (NanoFlow §4.1) hands the runner.

One decoder layer's pipeline, repeated for every layer: each original operation is cut
into nano-operations over contiguous row ranges of the dense batch, each nano-operation
is placed on a stream (one per bound resource on a GPU, one worker thread each on a CPU)
with a start time and a resource share. The record is plain data (JSON per model,
device and dense batch size); `check` is the independent checker every emitted schedule
must pass.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Resource = Literal["compute", "memory", "network"]

# A decoder layer's operations in dependency order; each depends on the one before it on
# the rows both touch (NanoFlow §4.1.2: dependency by intersection of batch ranges).
# "attention" is decode and prefill attention of the rows' sequences. The collectives
# exist only under tensor parallelism, in one of two partitionings of the attention half
# (`op_graph.PARTITIONINGS`): "allreduce_attn" after a row-sharded O projection, or
# "allgather_attn" before and "allgather_o" after a column-sharded one. A layer holds
# the ops of one partitioning, in this order.
LAYER_OPS: tuple[str, ...] = (
    "input_norm", "qkv", "rope_kv_write", "attention", "allgather_attn", "o_proj",
    "allreduce_attn", "allgather_o", "post_norm", "gate_up", "silu_mul", "down",
    "allreduce_mlp",
)  # fmt: skip
COLLECTIVES = frozenset(op for op in LAYER_OPS if op.startswith(("allreduce", "allgather")))


@dataclass(frozen=True)
class NanoOp:
    """One nano-operation: `op` over dense-batch rows [row_start, row_end)."""

    op: str  # one of LAYER_OPS
    row_start: int
    row_end: int
    resource: Resource
    stream: int  # which stream / worker thread runs it
    start_us: float  # planned start within the layer
    duration_us: float  # planned duration (D_best / P after Stage II)
    share: float = 1.0  # Stage II resource share R (1.0: no sharing)


@dataclass(frozen=True)
class Schedule:
    """A per-layer pipeline for one (model, device, dense batch size)."""

    model: str
    device: str
    dense_batch: int
    nano_ops: tuple[NanoOp, ...]  # in issue order per stream
    sequential_us: float  # the same layer unsplit, one op after another
    notes: dict = field(default_factory=dict)

    @property
    def makespan_us(self) -> float:
        return max((n.start_us + n.duration_us for n in self.nano_ops), default=0.0)

    @property
    def is_split(self) -> bool:
        return any(n.row_start > 0 for n in self.nano_ops)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        raw = json.loads(text)
        raw["nano_ops"] = tuple(NanoOp(**n) for n in raw["nano_ops"])
        return cls(**raw)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> Schedule:
        return cls.from_json(path.read_text())


def depends_on(later: NanoOp, earlier: NanoOp) -> bool:
    """NanoFlow's rule: B depends on A iff B's op follows A's in the layer and their
    row ranges intersect."""
    ops = LAYER_OPS
    overlap = later.row_start < earlier.row_end and earlier.row_start < later.row_end
    return overlap and ops.index(later.op) > ops.index(earlier.op)


def check(schedule: Schedule, eps_us: float = 1e-6) -> list[str]:
    """Every violation in `schedule` (empty when it is valid): each op's nano-operations
    tile [0, dense_batch) exactly; no nano-operation starts before one it depends on ends;
    nano-operations on one stream do not overlap in time."""
    problems: list[str] = []
    ops = schedule.nano_ops
    for name in {n.op for n in ops}:
        if name not in LAYER_OPS:
            problems.append(f"unknown op {name!r}")
            continue
        ranges = sorted((n.row_start, n.row_end) for n in ops if n.op == name)
        edge = 0
        for start, end in ranges:
            if start != edge or end <= start:
                problems.append(f"{name}: rows {ranges} do not tile [0, {schedule.dense_batch})")
                break
            edge = end
        else:
            if edge != schedule.dense_batch:
                problems.append(f"{name}: rows end at {edge}, not {schedule.dense_batch}")
    names = {n.op for n in ops}
    if "allreduce_attn" in names and names & {"allgather_attn", "allgather_o"}:
        problems.append("the attention half mixes the all-reduce and all-gather partitionings")
    known = [n for n in ops if n.op in LAYER_OPS]  # an unknown op is reported above
    for b in known:
        for a in known:
            if depends_on(b, a) and b.start_us + eps_us < a.start_us + a.duration_us:
                problems.append(
                    f"{b.op}[{b.row_start}:{b.row_end}] starts at {b.start_us:.3f} us before "
                    f"{a.op}[{a.row_start}:{a.row_end}] ends at {a.start_us + a.duration_us:.3f}"
                )
    by_stream: dict[int, list[NanoOp]] = {}
    for n in ops:
        by_stream.setdefault(n.stream, []).append(n)
    for stream, members in by_stream.items():
        members.sort(key=lambda n: n.start_us)
        for a, b in zip(members, members[1:], strict=False):
            if b.start_us + eps_us < a.start_us + a.duration_us:
                problems.append(f"stream {stream}: {a.op} and {b.op} overlap in time")
    period = schedule.notes.get("period_us")
    if period is not None:
        problems += _check_periodic(known, by_stream, period, eps_us)
    return problems


def _check_periodic(ops: list[NanoOp], by_stream: dict, period: float, eps_us: float) -> list[str]:
    """A cyclic schedule (layer l + 1 starts `period` after layer l): the next layer's
    first op waits for this layer's last op on the rows both touch, and no two
    nano-operations of one stream overlap in any pair of layers (modulo the period)."""
    problems = []
    present = [o for o in LAYER_OPS if any(n.op == o for n in ops)]
    for a in (n for n in ops if n.op == present[-1]):
        for b in (n for n in ops if n.op == present[0]):
            rows = a.row_start < b.row_end and b.row_start < a.row_end
            if rows and b.start_us + period + eps_us < a.start_us + a.duration_us:
                problems.append(
                    f"next layer's {b.op}[{b.row_start}:{b.row_end}] starts before "
                    f"{a.op}[{a.row_start}:{a.row_end}] ends"
                )
    for stream, members in by_stream.items():
        for i, a in enumerate(members):
            for b in members[i:]:
                # b's copy in the layer whose start falls in [a's start, + period) must
                # start after a ends and end before a's next copy starts.
                offset = (b.start_us - a.start_us) % period
                if offset > period - eps_us:
                    offset -= period
                clear = a.duration_us - eps_us <= offset <= period - b.duration_us + eps_us
                if a is b and a.duration_us > period + eps_us or a is not b and not clear:
                    problems.append(
                        f"stream {stream}: {a.op}[{a.row_start}:{a.row_end}] and "
                        f"{b.op}[{b.row_start}:{b.row_end}] overlap across layers"
                    )
    return problems

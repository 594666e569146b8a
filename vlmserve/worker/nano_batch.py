"""Nano-batched execution (NanoFlow §4.2): which schedule a step runs, and the step's
nano-batches.

A `Schedule` (search/nanoflow/schedule.py) is one decoder layer's pipeline for a dense batch of
`dense_batch` rows. For a step of N rows this module maps every row boundary of the
schedule to a boundary of the step (scaled by N / dense_batch, then snapped to the
nearest sequence start: attention of a nano-batch needs whole sequences, and a prefill
chunk's rows belong to one sequence), drops nano-operations left empty, derives the
dependencies from the mapped rows (`search.nanoflow.schedule.depends_on`, and across layers: any
op of the next layer after any op of this one on a shared row), and builds each
attention nano-batch's backend metadata, all once per step on the host. `nano_exec.py`
runs the result.

`--nano-batch auto` takes the schedules the auto-search finds for the engine's own model
and device (vlmserve/worker/nano_schedules.py, cached by decoder shape); a path names them.

The plain path runs instead (`NanoBatcher.plan` returns None) when no schedule's dense
batch is at most N, when the chosen schedule does not pay (its makespan is not below
its sequential time) or is not split, or when the step's sequences leave no two
non-empty nano-batches for some op (one long prefill chunk).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kernels.attention import AttentionBackend, AttentionBatch
from search.nanoflow.schedule import COLLECTIVES, LAYER_OPS, NanoOp, Schedule, check, depends_on
from vlmserve.config import EngineConfig

log = logging.getLogger(__name__)

# Tensor parallelism's collectives have nothing to run on one device (where either
# partitioning of the O projection is the same product).
_REQUIRED = tuple(op for op in LAYER_OPS if op not in COLLECTIVES)


@dataclass(frozen=True)
class NanoTask:
    """One nano-operation of a layer, on this step's rows [start, end)."""

    op: str
    start: int
    end: int
    stream: int
    # What it waits for, as (stream, tasks of that stream done): in its own layer, and
    # in the layer before (counted from that layer's first task on the stream).
    waits: tuple[tuple[int, int], ...]
    prev_waits: tuple[tuple[int, int], ...]
    meta_index: int | None  # attention: its nano-batch's metadata in NanoStep.metadata


@dataclass
class NanoStep:
    """A step's nano-batched layer, the same for every layer. `metadata`: a list (the
    runner moves its tensors to the device with the step's other metadata)."""

    tasks: list[NanoTask]  # in issue order (the schedule's start times)
    streams: list[list[int]]  # per stream: its tasks' indices, in issue order
    metadata: list[object]  # per attention nano-batch, the backend's
    schedule_batch: int  # the dense batch of the schedule it came from


def validate(schedule: Schedule) -> None:
    """Raise ValueError unless the runtime can run `schedule`: it passes `check` (rows
    tile the batch, no nano-operation starts before one it depends on ends, no two
    overlap on a stream) and has every op of a one-device layer."""
    problems = check(schedule)
    missing = [op for op in _REQUIRED if op not in {n.op for n in schedule.nano_ops}]
    if missing:
        problems.append(f"ops missing: {missing}")
    if problems:
        raise ValueError(
            f"schedule for dense batch {schedule.dense_batch} refused: " + "; ".join(problems)
        )


def pays(schedule: Schedule) -> bool:
    """The schedule's own verdict: split, and its makespan below the unsplit layer's."""
    return schedule.is_split and schedule.makespan_us < schedule.sequential_us


def load_schedules(path: str | Path) -> list[Schedule]:
    """The schedules in a JSON file, or in every *.json of a folder; each validated."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"no schedule JSON in {path}")
    schedules = []
    for file in files:
        try:
            schedule = Schedule.load(file)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{file}: not a schedule ({e})") from None
        validate(schedule)
        schedules.append(schedule)
    return schedules


def nano_schedules(config: EngineConfig, device: torch.device) -> list[Schedule]:
    """The schedules `config.model.nano_batch` names: none ("off"), the auto-search's for
    this model and device ("auto"), or those of a file or folder."""
    choice = config.model.nano_batch
    if choice == "off":
        return []
    if choice != "auto":
        return load_schedules(choice)
    from vlmserve.worker.nano_schedules import engine_schedules

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    max_rows = config.scheduler.max_num_batched_tokens
    found = engine_schedules(config.model.path, device.type, max_rows, name)
    log.info(
        "nano-batch auto: %d schedule(s) %s in %.1f s; overlap pays at dense batch %s",
        len(found.schedules), "from the cache" if found.cached else "searched",
        found.seconds, found.paying_batches or "none (steps run unsplit)",
    )  # fmt: skip
    return found.schedules


class NanoBatcher:
    """Chooses a step's schedule and maps it onto the step (host side, once per step)."""

    def __init__(
        self, schedules: list[Schedule], backend: AttentionBackend, always: bool = False
    ) -> None:
        for schedule in schedules:
            validate(schedule)
        self.schedules = sorted(schedules, key=lambda s: s.dense_batch)
        self._batches = [s.dense_batch for s in self.schedules]
        self.backend = backend
        # Split even where the schedule says it does not pay (benchmarks measure both).
        self.always = always

    def schedule_for(self, num_rows: int) -> Schedule | None:
        """The schedule of the largest dense batch <= num_rows, if it pays."""
        i = bisect.bisect_right(self._batches, num_rows)
        if i == 0:
            return None
        chosen = self.schedules[i - 1]
        return chosen if self.always or pays(chosen) else None

    @property
    def num_streams(self) -> int:
        return 1 + max(n.stream for s in self.schedules for n in s.nano_ops)

    def plan(self, batch: AttentionBatch, slot_mapping: torch.Tensor) -> NanoStep | None:
        """The step's nano-batches, or None for the plain path."""
        num_rows = sum(batch.query_lens)
        schedule = self.schedule_for(num_rows)
        if schedule is None:
            return None
        starts = [0]
        for q_len in batch.query_lens:
            starts.append(starts[-1] + q_len)
        ops = map_rows(schedule, starts)
        if ops is None:
            return None
        step = _tasks(ops, schedule)
        # One metadata per attention nano-batch: its sequences, rows from its own start.
        for task in step.tasks:
            if task.meta_index is None:
                continue
            first, last = starts.index(task.start), starts.index(task.end)
            sub = AttentionBatch(
                batch.query_lens[first:last], batch.context_lens[first:last],
                batch.block_tables[first:last], batch.block_size,
            )  # fmt: skip
            meta = self.backend.build_metadata(
                sub, slot_mapping[task.start : task.end], torch.device("cpu")
            )
            step.metadata.append(meta)
        return step


def map_rows(schedule: Schedule, starts: list[int]) -> list[NanoOp] | None:
    """The schedule's non-empty nano-operations on a step whose sequences start at
    `starts` (with the end last): each boundary scaled to the step and snapped to the
    nearest sequence start (ties to the lower). Monotone, so rows that did not intersect
    still do not; None when no op is left split (the step cannot be split)."""
    num_rows = starts[-1]

    def snap(row: int) -> int:
        target = row * num_rows / schedule.dense_batch
        i = bisect.bisect_left(starts, target)
        if i == len(starts):
            return num_rows
        if i > 0 and target - starts[i - 1] <= starts[i] - target:
            return starts[i - 1]
        return starts[i]

    mapped = [
        replace(n, row_start=snap(n.row_start), row_end=snap(n.row_end))
        for n in schedule.nano_ops
        if n.op not in COLLECTIVES
    ]
    mapped = [n for n in mapped if n.row_end > n.row_start]
    if not any(n.row_start > 0 for n in mapped):
        return None
    return mapped


def _issue_key(n: NanoOp) -> tuple[float, int, int]:
    # Dependencies go to a later start, or (zero durations) to a later op: this order
    # never issues a task before one it waits for.
    return (n.start_us, LAYER_OPS.index(n.op), n.row_start)


def _tasks(ops: list[NanoOp], schedule: Schedule) -> NanoStep:
    """Tasks in issue order with their waits reduced to per-stream counts. Attention
    tasks also wait for the attention task before them (the backends reuse gather
    buffers across calls, so two attentions never run at once)."""
    ops = sorted(ops, key=_issue_key)
    num_streams = 1 + max(n.stream for n in ops)
    position: list[int] = []  # each task's index within its stream
    count = [0] * num_streams
    for n in ops:
        position.append(count[n.stream])
        count[n.stream] += 1
    attention = [i for i, n in enumerate(ops) if n.op == "attention"]
    tasks, streams = [], [[] for _ in range(num_streams)]
    for i, n in enumerate(ops):
        same = [j for j in range(i) if depends_on(n, ops[j])]
        # Every op of the layer before comes first in the layer order (LAYER_OPS).
        prev = [j for j, m in enumerate(ops) if _intersect(n, m)]
        if n.op == "attention":
            k = attention.index(i)
            if k > 0:
                same.append(attention[k - 1])
            else:
                prev.append(attention[-1])
        tasks.append(
            NanoTask(
                n.op, n.row_start, n.row_end, n.stream,
                _reduce(same, ops, position, n.stream), _reduce(prev, ops, position, n.stream),
                attention.index(i) if n.op == "attention" else None,
            )
        )  # fmt: skip
        streams[n.stream].append(i)
    return NanoStep(tasks, streams, [], schedule.dense_batch)


def _intersect(a: NanoOp, b: NanoOp) -> bool:
    return a.row_start < b.row_end and b.row_start < a.row_end


def _reduce(
    deps: list[int], ops: list[NanoOp], position: list[int], own_stream: int | None
) -> tuple[tuple[int, int], ...]:
    """Dependencies as (stream, number of its tasks that must be done): the latest per
    stream. Waits on the task's own stream are kept by stream order (a stream runs all
    of a layer's tasks before the next layer's)."""
    need: dict[int, int] = {}
    for j in deps:
        stream = ops[j].stream
        if stream == own_stream:
            continue
        need[stream] = max(need.get(stream, 0), position[j] + 1)
    return tuple(sorted(need.items()))

"""Hand-made nano-batch schedules: NanoFlow's two published pipeline shapes, timed by
list scheduling (every nano-operation as soon as its dependencies and its stream allow).

These are not searched: the auto-search (Stage I/II MILPs) chooses sizes and order from
profiles. They give the runtime and its benchmark known, valid schedules to execute:
NanoFlow §4.1's 8B pipeline (two nano-batches, the decode attention of one beside the
GEMMs of the other) and the shape of its 70B pipeline (four nano-operations over the
KQV / attention segment, two over Up/Gate/Down), both without collectives (one device).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from search.nanoflow.schedule import (
    COLLECTIVES,
    LAYER_OPS,
    NanoOp,
    Resource,
    Schedule,
    check,
    depends_on,
)

# (op, rows) -> interference-free duration in microseconds (a profile, or a guess)
DurationUs = Callable[[str, int], float]
# Per stream, its nano-operations in issue order: (op, row_start, row_end)
StreamLayout = Sequence[Sequence[tuple[str, int, int]]]

# The bound resource of each decoder op (NanoFlow Table 2: the projections are GEMMs,
# decode attention a batched GEMV over the KV cache; norms, RoPE and SiLU-mul stream
# their activations once).
OP_RESOURCE: dict[str, Resource] = {
    "input_norm": "memory", "qkv": "compute", "rope_kv_write": "memory",
    "attention": "memory", "o_proj": "compute", "allreduce_attn": "network",
    "post_norm": "memory", "gate_up": "compute", "silu_mul": "memory", "down": "compute",
    "allreduce_mlp": "network", "allgather_attn": "network", "allgather_o": "network",
}  # fmt: skip
SINGLE_DEVICE_OPS = tuple(op for op in LAYER_OPS if op not in COLLECTIVES)
ATTENTION_SEGMENT = ("input_norm", "qkv", "rope_kv_write", "attention", "o_proj")
MLP_SEGMENT = ("post_norm", "gate_up", "silu_mul", "down")


def list_schedule(
    model: str, device: str, dense_batch: int, layout: StreamLayout, duration_us: DurationUs
) -> Schedule:
    """Start times by list scheduling: each stream issues its nano-operations in order,
    each as soon as the nano-operations it depends on (NanoFlow's rule) have ended.
    Raises ValueError when the layout cannot run (a dependency waits on something issued
    later on its own stream) or its rows do not tile the batch."""
    pending = [list(stream) for stream in layout]
    free_at = [0.0] * len(layout)
    placed: list[NanoOp] = []
    while any(pending):
        progressed = False
        for stream, queue in enumerate(pending):
            while queue:
                op, start, end = queue[0]
                probe = NanoOp(op, start, end, OP_RESOURCE[op], stream, 0.0, 0.0)
                waits = [n for n in placed if depends_on(probe, n)]
                unplaced = [
                    (o, s, e) for q in pending for (o, s, e) in q
                    if (o, s, e) != (op, start, end)
                    and depends_on(probe, NanoOp(o, s, e, OP_RESOURCE[o], 0, 0.0, 0.0))
                ]  # fmt: skip
                if unplaced:
                    break
                begin = max([free_at[stream]] + [n.start_us + n.duration_us for n in waits])
                placed.append(
                    NanoOp(op, start, end, OP_RESOURCE[op], stream, begin,
                           duration_us(op, end - start))
                )  # fmt: skip
                free_at[stream] = placed[-1].start_us + placed[-1].duration_us
                queue.pop(0)
                progressed = True
        if not progressed:
            raise ValueError("layout deadlocks: a stream waits on one issued after it")
    ops = {n.op for n in placed}
    sequential = sum(duration_us(op, dense_batch) for op in LAYER_OPS if op in ops)
    schedule = Schedule(model, device, dense_batch, tuple(placed), sequential)
    problems = check(schedule)
    if problems:
        raise ValueError("; ".join(problems))
    return schedule


def sequential_schedule(
    model: str, device: str, dense_batch: int, duration_us: DurationUs
) -> Schedule:
    """The unsplit layer, one op after another on one stream (is_split is False)."""
    layout = [[(op, 0, dense_batch) for op in SINGLE_DEVICE_OPS]]
    return list_schedule(model, device, dense_batch, layout, duration_us)


def two_way_schedule(
    model: str, device: str, dense_batch: int, duration_us: DurationUs, split: int | None = None
) -> Schedule:
    """NanoFlow's 8B pipeline: two nano-batches [0, split) and [split, B); stream 0 runs
    every op but attention (nano-batch 1's attention segment, then 2's, then 1's MLP,
    then 2's), stream 1 the decode attention, so attention 1 overlaps the KQV of
    nano-batch 2 and attention 2 the O projection and Up/Gate/Down of nano-batch 1."""
    split = dense_batch // 2 if split is None else split
    halves = [(0, split), (split, dense_batch)]
    before = ("input_norm", "qkv", "rope_kv_write")
    compute = [(op, s, e) for s, e in halves for op in before]
    compute += [(op, s, e) for s, e in halves for op in ("o_proj", *MLP_SEGMENT)]
    memory = [("attention", s, e) for s, e in halves]
    return list_schedule(model, device, dense_batch, [compute, memory], duration_us)


def four_two_schedule(
    model: str, device: str, dense_batch: int, duration_us: DurationUs
) -> Schedule:
    """The shape of NanoFlow's 70B pipeline without its collectives: four nano-operations
    over the attention segment (rows cut 3/8, 3/8, 1/8, 1/8 as in Figure 6's 768, 768,
    256, 256 of 2,048), two over the MLP; attention on stream 1."""
    cuts = [0, 3 * dense_batch // 8, 6 * dense_batch // 8, 7 * dense_batch // 8, dense_batch]
    quarters = list(zip(cuts, cuts[1:], strict=False))
    halves = [(0, cuts[2]), (cuts[2], dense_batch)]
    compute = []
    for s, e in quarters:
        compute += [(op, s, e) for op in ("input_norm", "qkv", "rope_kv_write")]
    compute += [("o_proj", s, e) for s, e in quarters]
    compute += [(op, s, e) for s, e in halves for op in MLP_SEGMENT]
    memory = [("attention", s, e) for s, e in quarters]
    return list_schedule(model, device, dense_batch, [compute, memory], duration_us)

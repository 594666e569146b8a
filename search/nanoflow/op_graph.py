"""One decoder layer as an operation graph: what each op of `LAYER_OPS` costs per device.

NanoFlow §4.1 starts its search from the model's operation graph annotated with each
op's bound resource. Here every op is a straight chain (each op depends on the one
before it, row by row) and its work is linear in the number of rows it runs over:
FLOPs and bytes are a fixed part (the weights, read once per kernel launch, i.e. once
per nano-operation) plus a part per row. Under tensor parallelism heads and the MLP are
sharded `tp` ways and the MLP ends in an all-reduce; the attention half is partitioned
one of two ways (`PARTITIONINGS`), the same bytes on the wire, the same FLOPs:

- "allreduce" (Megatron): O is sharded by its input rows, its partial sums all-reduced
  (2(n-1)/n of d per row);
- "allgather" (NanoFlow Fig. 4, §4.1.2's "operation transformations"): the attention
  outputs are all-gathered ((n-1)/n of the query width), O is sharded by its output
  columns, and its outputs all-gathered ((n-1)/n of d). One more collective, and a
  network op right after decode attention, where three resources can overlap.

The search takes each as an option (`auto_search.best_partitioning`). With tp = 1 the
collectives are not in the graph and the two are one.

Attention covers the decode rows (each reads its sequence's cache: memory-bound) and the
prefill rows (compute-bound, every row against its chunk's keys). The search prices a
nano-batch as if every nano-batch held the dense batch's mix of the two (`BatchMix`);
the runtime keeps that true by interleaving decode and prefill rows (see Schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from search.costmodel import cost_model as cm
from search.costmodel.presets import Accelerator, ModelShape
from search.nanoflow.schedule import LAYER_OPS, Resource

Partitioning = Literal["allreduce", "allgather"]
PARTITIONINGS: tuple[Partitioning, ...] = ("allreduce", "allgather")
_NOT_IN = {"allreduce": ("allgather_attn", "allgather_o"), "allgather": ("allreduce_attn",)}


@dataclass(frozen=True)
class BatchMix:
    """What the dense batch's rows are: the share that decodes and their context.

    `decode_context` None: the decode rows' caches fill the device's memory beside the
    weights (NanoFlow's setting, §3.2: B_dense is the largest batch whose KV fits).
    """

    decode_fraction: float = 0.5  # NanoFlow 70B: ~1024 decodes in a 2048-token batch
    decode_context: int | None = None
    prefill_context: int = 512  # keys each prefill row attends (a chunk's span)
    workspace_bytes: float = 2e9

    def __post_init__(self) -> None:
        if not 0 <= self.decode_fraction <= 1:
            raise ValueError(f"decode_fraction must be in [0, 1], got {self.decode_fraction}")
        if self.decode_context is not None and self.decode_context < 1:
            raise ValueError(f"decode_context must be >= 1, got {self.decode_context}")


@dataclass(frozen=True)
class LayerOp:
    """One op of a layer on one device; its work over `rows` rows is fixed + rows·per_row."""

    name: str  # one of LAYER_OPS
    resource: Resource
    fixed_flops: float
    flops_per_row: float
    fixed_bytes: float  # weights: read again by every nano-operation
    bytes_per_row: float  # activations and KV cache
    net_bytes_per_row: float = 0.0  # bytes each device sends per row (collectives)
    latency_s: float = 0.0  # a collective's fixed latency

    def flops(self, rows: int) -> float:
        return self.fixed_flops + rows * self.flops_per_row

    def bytes(self, rows: int) -> float:
        return self.fixed_bytes + rows * self.bytes_per_row


def decode_context_filling_memory(
    model: ModelShape, accel: Accelerator, dense_batch: int, mix: BatchMix, tp: int = 1
) -> int:
    """Context at which the decode rows' caches fill what the weights leave of the device."""
    free = accel.memory_bytes - cm.weight_bytes_total(model) / tp - mix.workspace_bytes
    per_token = cm.kv_bytes_per_token(model) / cm.cache_shards(model, tp)
    num_decodes = max(1, round(dense_batch * mix.decode_fraction))
    context = int(free / (per_token * num_decodes))
    if context < 1:
        raise ValueError(f"{model.name} at tp {tp} leaves no KV cache on {accel.name}")
    return context


def layer_ops(
    model: ModelShape,
    accel: Accelerator,
    dense_batch: int,
    tp: int = 1,
    mix: BatchMix | None = None,
    elem_bytes: float = 2.0,
    partitioning: Partitioning = "allreduce",
) -> tuple[LayerOp, ...]:
    """The layer's ops on one of `tp` devices, in LAYER_OPS order (collectives only if tp > 1),
    with the attention half's collectives of `partitioning`."""
    mix = mix or BatchMix()
    if tp < 1 or model.num_heads % tp or model.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide {model.name}'s heads and MLP")
    if partitioning not in PARTITIONINGS:
        raise ValueError(f"partitioning must be one of {PARTITIONINGS}, got {partitioning!r}")
    s, d = elem_bytes, model.hidden_size
    q = model.num_heads * model.head_dim / tp
    kv = model.num_kv_heads * model.head_dim / cm.cache_shards(model, tp)
    ff = model.intermediate_size / tp
    context = mix.decode_context or decode_context_filling_memory(
        model, accel, dense_batch, mix, tp
    )
    # Per row of the mix: a decode row reads `context` cached K and V rows of this layer,
    # a prefill row attends `prefill_context` keys it mostly has in cache already.
    keys_per_row = mix.decode_fraction * context + (1 - mix.decode_fraction) * mix.prefill_context
    kv_read_per_row = mix.decode_fraction * context * 2 * kv * s

    def gemm(name: str, k: float, n: float) -> LayerOp:
        return LayerOp(name, "compute", 0.0, 2 * k * n, k * n * s, (k + n) * s)

    def streaming(name: str, bytes_per_row: float, flops_per_row: float = 0.0) -> LayerOp:
        return LayerOp(name, "memory", 0.0, flops_per_row, 0.0, bytes_per_row)

    def collective(name: str, width: float, passes: int) -> LayerOp:
        # Ring all-reduce: each device sends 2(n-1)/n of the tensor (article §16); a ring
        # all-gather (n-1)/n of the gathered tensor, one pass.
        sent = passes * (tp - 1) / tp * width * s
        return LayerOp(name, "network", 0.0, 0.0, 0.0, 0.0, sent, accel.allreduce_latency_s)

    attention = LayerOp(
        "attention",
        "memory",
        0.0,
        4 * keys_per_row * q,  # QK^T and PV: 2 FLOPs each per (key, query dim)
        0.0,
        kv_read_per_row + 2 * q * s,
    )
    if cm.compute_time(attention.flops(dense_batch), accel.flops_bf16) > (
        attention.bytes(dense_batch) / accel.mem_bandwidth
    ):
        attention = LayerOp("attention", "compute", *_work(attention))
    ops = {
        "input_norm": streaming("input_norm", 2 * d * s, 4 * d),
        "qkv": gemm("qkv", d, q + 2 * kv),
        "rope_kv_write": streaming("rope_kv_write", (2 * q + 4 * kv) * s, 6 * (q + kv)),
        "attention": attention,
        # Either way a device multiplies q·d/tp per row: (q/tp)·d, or q·(d/tp).
        "o_proj": gemm("o_proj", q, d)
        if partitioning == "allreduce"
        else gemm("o_proj", q * tp, d / tp),
        "allreduce_attn": collective("allreduce_attn", d, 2),
        "allgather_attn": collective("allgather_attn", q * tp, 1),
        "allgather_o": collective("allgather_o", d, 1),
        "post_norm": streaming("post_norm", 2 * d * s, 4 * d),
        "gate_up": gemm("gate_up", d, 2 * ff),
        "silu_mul": streaming("silu_mul", 3 * ff * s, 4 * ff),
        "down": gemm("down", ff, d),
        "allreduce_mlp": collective("allreduce_mlp", d, 2),
    }
    names = [o for o in LAYER_OPS if o not in _NOT_IN[partitioning]]
    return tuple(ops[o] for o in names if tp > 1 or ops[o].resource != "network")


def _work(op: LayerOp) -> tuple[float, float, float, float]:
    return op.fixed_flops, op.flops_per_row, op.fixed_bytes, op.bytes_per_row


def op_time_s(op: LayerOp, rows: int, accel: Accelerator) -> float:
    """Interference-free seconds of `op` over `rows` rows on `accel`.

    Compute and memory terms are added, not maxed: a kernel that starts by streaming its
    weights does not hide that read under math it cannot start yet. That is the cost each
    extra nano-operation pays (NanoFlow §6's "Nanobatch-only" loss, 13.2% for 70B), which
    the max() roofline would price at zero for any nano-batch past the ridge. A collective
    is its latency plus its bytes over one direction of the device's interconnect (half
    the bidirectional figure: 2·7/8·33.5 MB / 300 GB/s per 70B layer half, NanoFlow
    Table 2's 31.3 ms of network per iteration over 80 layers).
    """
    if op.resource == "network":
        link = (accel.interconnect_bandwidth or accel.mem_bandwidth) / 2
        return op.latency_s + rows * op.net_bytes_per_row / link
    return op.flops(rows) / accel.flops_bf16 + op.bytes(rows) / accel.mem_bandwidth

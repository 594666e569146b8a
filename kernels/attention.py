"""Attention over a paged KV cache: the backend interface and the plain-torch backend.

A step's tokens arrive flattened (`[num_tokens, ...]`, sequences back to back). Each
sequence contributes `query_len` new tokens whose K/V are written to `slot_mapping` and
which attend to the first `context_len` slots of its block table (cached + new).
A layer's cache is head-major, `[2 (k, v), num_kv_heads, num_slots, head_dim]`, so one
gather of a group's slots yields contiguous `[kv_heads, seqs, context, head_dim]` operands
for batched matmuls. The layout is the backend's: `kv_cache_shape` says it, and the runner
allocates what it returns.
The torch backend runs on CPU and GPU alike and is the reference; the CPU backend
(kernels/cpu_attention.py) replaces its decode path with a C++ kernel over the same
layout. The GPU backends implement the same three methods: Triton
(kernels/triton_attention.py, this layout) and FlashInfer (kernels/flashinfer_attention.py,
its own paged layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

# Sequences with at most this many query tokens (decodes, speculative verification) are
# batched together with padding; longer ones (prefill chunks) run one by one unpadded.
SMALL_QUERY_LEN = 16


@dataclass(frozen=True)
class AttentionBatch:
    """What the runner knows about one step, in host lists (backend-independent)."""

    query_lens: list[int]
    context_lens: list[int]  # tokens each query attends to, new ones included
    block_tables: list[list[int]]
    block_size: int
    # Sliding-window layers: a query at position p sees keys at positions > p - window.
    sliding_window: int | None = None
    # Per sequence, [start, end) position ranges whose tokens see each other in full
    # (an image's tokens, Gemma 3); causal elsewhere. Each lies inside its query chunk.
    spans: list[list[tuple[int, int]]] | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive")

    def seq_spans(self, i: int) -> list[tuple[int, int]]:
        return self.spans[i] if self.spans is not None else []


@dataclass
class LayeredMetadata:
    """A step's metadata per KV cache group, for models whose layers differ (Gemma 3's
    global and sliding-window layers, each group with its own block tables and slots):
    layer l reads `groups[layer_group[l]]`."""

    groups: list[object]
    layer_group: tuple[int, ...]

    def for_layer(self, layer: int) -> object:
        return self.groups[self.layer_group[layer]]


# Query rows a long chunk's SDPA call takes at once (TorchPagedAttention._attend).
SDPA_QUERY_BLOCK = 256


def allowed_keys(
    q_pos: torch.Tensor, num_keys: int, window: int | None, spans: list[tuple[int, int]]
) -> torch.Tensor:
    """[len(q_pos), num_keys] bool: which key positions each query position may read.
    The reference rule every backend implements: causal, or both inside one span; and,
    with a window, key > query - window (transformers' Gemma 3 masks)."""
    k_pos = torch.arange(num_keys)[None, :]
    q_pos = q_pos[:, None]
    allowed = k_pos <= q_pos
    for start, end in spans:
        allowed |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


@dataclass
class _Group:
    q_index: torch.Tensor  # [S, Qm] flat token index of each (seq, query row); pads repeat
    q_valid: torch.Tensor  # [S, Qm] bool
    ctx_slots: torch.Tensor  # [S, Cm] cache slot of each context position
    bias: torch.Tensor  # [S, Qm, 1, Cm] float: 0 where the query may attend, -inf elsewhere
    # Built once per step, used by every layer: the flat token index of each valid
    # (seq, query row), and where those rows sit in the flattened [S * Qm] result (None
    # when no row is padding, as in an all-decode group).
    out_rows: torch.Tensor  # [num_valid]
    valid_rows: torch.Tensor | None  # [num_valid]
    _sdpa_blocks: tuple[torch.dtype, list] | None = None

    def sdpa_blocks(
        self, dtype: torch.dtype
    ) -> list[tuple[int, int, int, int, torch.Tensor | None]]:
        """The first sequence's query rows in blocks of SDPA_QUERY_BLOCK: (rows j0:j1, the
        keys k0:k1 any of them reads, their additive mask in `dtype`, None where it is
        plain causal). Made once a step for every layer. A window or causality leaves most
        of a long chunk's [queries, keys] masked: each block attends only over its keys
        (SDPA computes every masked score), and an additive mask of the query's dtype
        spares SDPA converting a bool one each call (Xeon with AMX, bfloat16, 2,048
        queries under a 512 window: 10.7 ms against 16.5 for one call)."""
        if self._sdpa_blocks is None or self._sdpa_blocks[0] != dtype:
            allowed = self.bias[0, :, 0] == 0  # [Q, C]
            q_len, c_len = allowed.shape
            lo = allowed.int().argmax(1)  # each row's first key (every row reads one)
            hi = c_len - allowed.flip(1).int().argmax(1)  # ... and one past its last
            blocks = []
            for j0 in range(0, q_len, SDPA_QUERY_BLOCK):
                j1 = min(q_len, j0 + SDPA_QUERY_BLOCK)
                k0, k1 = int(lo[j0:j1].min()), int(hi[j0:j1].max())
                part = allowed[j0:j1, k0:k1]
                causal = k1 - k0 == j1 - j0 and torch.equal(part, torch.ones_like(part).tril())
                mask = None if causal else self.bias[0, j0:j1, 0, k0:k1].to(dtype).contiguous()
                blocks.append((j0, j1, k0, k1, mask))
            self._sdpa_blocks = (dtype, blocks)
        return self._sdpa_blocks[1]


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where the new K/V go
    groups: list[_Group]
    # (start, end) token ranges of sequences with no cached context: their chunk is their
    # whole context, so they attend causally over this step's own K/V (no cache gather).
    fresh: list[tuple[int, int]]


class AttentionBackend(Protocol):
    name: str

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]: ...

    def build_metadata(
        self, batch: AttentionBatch, slot_mapping: torch.Tensor, device: torch.device
    ) -> object: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: object,
        scale: float,
    ) -> torch.Tensor: ...


def split_by_query_len(batch: AttentionBatch) -> tuple[list[int], list[int], list[int]]:
    """Each sequence's first flat token index; the single-token queries (decodes); the
    longer ones (chunks, verifications). The GPU backends' split."""
    starts, total = [], 0
    for q_len in batch.query_lens:
        starts.append(total)
        total += q_len
    decode = [i for i, q_len in enumerate(batch.query_lens) if q_len == 1]
    extend = [i for i, q_len in enumerate(batch.query_lens) if q_len > 1]
    return starts, decode, extend


def _slots(block_table: list[int], num_positions: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(num_positions)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def _group(
    members: list[int], batch: AttentionBatch, starts: list[int], device: torch.device
) -> _Group:
    q_max = max(batch.query_lens[i] for i in members)
    # Keys from the block holding the first query's window start: whole blocks before it
    # are never gathered (a hybrid KV pool may have given them to another sequence).
    firsts = [_window_start(batch, i) for i in members]
    c_max = max(batch.context_lens[i] - f for i, f in zip(members, firsts, strict=True))
    num = len(members)
    q_index = torch.zeros(num, q_max, dtype=torch.long)
    q_valid = torch.zeros(num, q_max, dtype=torch.bool)
    ctx_slots = torch.zeros(num, c_max, dtype=torch.long)
    mask = torch.zeros(num, q_max, c_max, dtype=torch.bool)
    for row, (i, first) in enumerate(zip(members, firsts, strict=True)):
        q_len, ctx_len = batch.query_lens[i], batch.context_lens[i]
        q_index[row, :q_len] = torch.arange(starts[i], starts[i] + q_len)
        q_index[row, q_len:] = starts[i]
        q_valid[row, :q_len] = True
        slots = _slots(batch.block_tables[i], ctx_len, batch.block_size)
        ctx_slots[row, : ctx_len - first] = slots[first:]
        # Padding reads (masked) a slot of its own: never another's block or the null one.
        ctx_slots[row, ctx_len - first :] = slots[first]
        # Query j sits at absolute position ctx_len - q_len + j and sees positions <= it.
        q_pos = torch.arange(q_len) + (ctx_len - q_len)
        allowed = allowed_keys(q_pos, ctx_len, batch.sliding_window, batch.seq_spans(i))
        mask[row, :q_len, : ctx_len - first] = allowed[:, first:]
        mask[row, q_len:, 0] = True  # padded rows see one slot: no NaN, result discarded
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))[:, :, None]
    flat_valid = q_valid.flatten()
    valid_rows = None if bool(flat_valid.all()) else flat_valid.nonzero().squeeze(1).to(device)
    return _Group(
        q_index.to(device), q_valid.to(device), ctx_slots.to(device), bias.to(device),
        q_index.flatten()[flat_valid].to(device), valid_rows,
    )  # fmt: skip


def _window_start(batch: AttentionBatch, i: int) -> int:
    """The first position sequence i's attention reads: the start of the block holding its
    first query's window start (0 without a window)."""
    if batch.sliding_window is None:
        return 0
    first_query = batch.context_lens[i] - batch.query_lens[i]
    lo = max(0, first_query - batch.sliding_window + 1)
    return lo // batch.block_size * batch.block_size


def _buckets(members: list[int], context_lens: list[int], max_waste: float = 1.3):
    """Split sequences into groups of similar context length, so that padding each group
    to its longest context gathers at most `max_waste` times the useful KV."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in sorted(members, key=lambda i: context_lens[i]):
        ctx = context_lens[i]
        if current and ctx * (len(current) + 1) > max_waste * (total + ctx):
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += ctx
    if current:
        groups.append(current)
    return groups


class TorchPagedAttention:
    """Gathers each group's context from the paged cache into reused buffers and runs
    batched matmuls (SDPA for a long chunk on top of a prefix)."""

    name = "torch"

    def __init__(self) -> None:
        # Gather destinations for keys and values, reused by every layer and step: a fresh
        # multi-MB tensor per layer costs more in page faults than the gather itself
        # (glibc serves allocations over 32 MB with new zeroed pages each time).
        self._buffers = [torch.empty(0), torch.empty(0)]

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int]:
        """One layer's cache: [2 (k, v), num_kv_heads, num_slots, head_dim], where
        slot = block * block_size + offset."""
        return (2, num_kv_heads, num_blocks * block_size, head_dim)

    def _gather(self, cache: torch.Tensor, slots: torch.Tensor, which: int) -> torch.Tensor:
        """cache [KVH, num_slots, D] rows at `slots` -> [KVH, len(slots), D]."""
        kv_heads, _, dim = cache.shape
        numel = kv_heads * slots.numel() * dim
        buffer = self._buffers[which]
        if buffer.numel() < numel or buffer.dtype != cache.dtype or buffer.device != cache.device:
            buffer = self._buffers[which] = cache.new_empty(numel)
        out = buffer[:numel].view(kv_heads, slots.numel(), dim)
        return torch.index_select(cache, 1, slots, out=out)

    def build_metadata(
        self, batch: AttentionBatch, slot_mapping: torch.Tensor, device: torch.device
    ) -> TorchAttentionMetadata:
        meta, starts, small = self._split(batch, slot_mapping, device)
        buckets = _buckets(small, batch.context_lens)
        meta.groups += [_group(m, batch, starts, device) for m in buckets]
        return meta

    def _split(
        self, batch: AttentionBatch, slot_mapping: torch.Tensor, device: torch.device
    ) -> tuple[TorchAttentionMetadata, list[int], list[int]]:
        """The metadata of the fresh prefills and the long chunks on a prefix; each
        sequence's first flat token index; and the sequences with short queries (decodes,
        verifications), which each backend batches its own way."""
        starts, total = [], 0
        for q_len in batch.query_lens:
            starts.append(total)
            total += q_len
        lens = list(zip(batch.query_lens, batch.context_lens, strict=True))
        # A window or spans need a mask: such prefills take the gathering path (a window
        # no shorter than the context masks nothing).
        window = batch.sliding_window
        plain = [(window is None or c <= window) and not batch.seq_spans(i)
                 for i, (_, c) in enumerate(lens)]  # fmt: skip
        fresh = [i for i, (q, c) in enumerate(lens) if q > SMALL_QUERY_LEN and q == c and plain[i]]
        small = [i for i, (q, _) in enumerate(lens) if q <= SMALL_QUERY_LEN]
        large = [
            i for i, (q, c) in enumerate(lens)
            if q > SMALL_QUERY_LEN and (q != c or not plain[i])
        ]  # fmt: skip
        groups = [_group([i], batch, starts, device) for i in large]
        ranges = [(starts[i], starts[i] + batch.query_lens[i]) for i in fresh]
        return TorchAttentionMetadata(slot_mapping.to(device), groups, ranges), starts, small

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        # kv_cache: [2, num_kv_heads, num_slots, head_dim], in --kv-cache-dtype (may differ
        # from q's: K/V are rounded into it here and read back as q's dtype)
        kv_cache[0].index_copy_(1, metadata.slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
        kv_cache[1].index_copy_(1, metadata.slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))
        out = torch.empty_like(q)
        self._attend(out, q, k, v, kv_cache, metadata, scale)
        return out

    def _attend(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> None:
        """Fill `out` for the fresh prefills and every group (their K/V are in the cache)."""
        for start, end in metadata.fresh:
            qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, len, D]
            os = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
            out[start:end] = os.transpose(0, 1)
        for g in metadata.groups:
            if g.q_index.shape[1] > SMALL_QUERY_LEN:  # one long chunk on top of a prefix
                slots = g.ctx_slots[0]
                ks, vs = self._gather(kv_cache[0], slots, 0), self._gather(kv_cache[1], slots, 1)
                ks, vs = ks.to(q.dtype), vs.to(q.dtype)
                rows = g.q_index[0]
                qs = q[rows].transpose(0, 1)  # [H, Q, D]
                os = torch.empty_like(qs)
                for j0, j1, k0, k1, mask in g.sdpa_blocks(q.dtype):
                    os[:, j0:j1] = F.scaled_dot_product_attention(
                        qs[:, j0:j1], ks[:, k0:k1], vs[:, k0:k1], attn_mask=mask,
                        is_causal=mask is None, scale=scale, enable_gqa=True,
                    )  # fmt: skip
                out.index_copy_(0, rows, os.transpose(0, 1))
                continue
            og = self._grouped_attention(q, kv_cache, g, scale).flatten(0, 1)  # [S*Qm, H, D]
            if g.valid_rows is not None:
                og = og.index_select(0, g.valid_rows)
            out.index_copy_(0, g.out_rows, og)

    def _grouped_attention(
        self, q: torch.Tensor, kv_cache: torch.Tensor, g: _Group, scale: float
    ) -> torch.Tensor:
        """Padded attention of a group of sequences over their gathered context, as two
        batched matmuls per KV head: the query heads sharing a KV head form the rows of one
        matmul, so GQA needs no K/V expansion. Returns [S, Qm, num_heads, head_dim]."""
        num_seqs, q_max = g.q_index.shape
        ctx_max = g.ctx_slots.shape[1]
        _, kv_heads, _, dim = kv_cache.shape
        group = q.shape[1] // kv_heads
        slots = g.ctx_slots.flatten()
        keys = self._gather(kv_cache[0], slots, 0).view(kv_heads, num_seqs, ctx_max, dim)
        values = self._gather(kv_cache[1], slots, 1).view(kv_heads, num_seqs, ctx_max, dim)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        # [S*Qm, H, D] -> [KVH, S, Qm*G, D]; query head h uses KV head h // G.
        queries = (q.index_select(0, g.q_index.flatten()) * scale).view(
            num_seqs, q_max, kv_heads, group, dim
        )
        queries = queries.permute(2, 0, 1, 3, 4).reshape(kv_heads, num_seqs, q_max * group, dim)
        scores = torch.matmul(queries, keys.transpose(-1, -2))  # [KVH, S, Qm*G, C]
        scores = scores.view(kv_heads, num_seqs, q_max, group, ctx_max).add_(g.bias)
        probs = scores.softmax(-1).view(kv_heads, num_seqs, q_max * group, ctx_max)
        out = torch.matmul(probs, values).view(kv_heads, num_seqs, q_max, group, dim)
        return out.permute(1, 2, 0, 3, 4).reshape(num_seqs, q_max, kv_heads * group, dim)

"""Paged attention in Triton: a GQA-aware split-K decode kernel and a prefill/extend kernel
for chunks on top of a cached prefix, over the torch backend's cache layout.

The cache is the torch backend's (`[2, num_kv_heads, num_slots, head_dim]`, slot = block *
block_size + offset), so the K/V write, the runner's allocation and every test helper are
shared, and the plain-torch backend (kernels/attention.py) is the reference beside it.

Decode (one query token per sequence): one program per (sequence, KV head, split). The
program loads the query heads that share its KV head as the rows of one tile, so each K/V
block is read once for the whole group (GQA without expanding K/V), walks its split of the
context one cache block at a time with an online softmax, and writes an unnormalised
partial (acc, max, sum). A second kernel merges the splits. Splitting the context keeps a
GPU busy at batch 1 over long contexts (SGLang's and vLLM's Triton decode do the same).

Extend (2+ query tokens: prefill chunks, speculative verification): one program per
(sequence, KV head, tile of (query row, group head) pairs), causal over the cached prefix
plus the chunk; the group's heads share each K/V block read, as in decode.

Sliding windows and bidirectional spans (Gemma 3): a query sees keys [lo, hi], lo past
the window (`window` > 0; whole blocks before it never read), hi its position or, in
the extend kernel, its span's end - 1 (`key_ends`, per flat token).

On a CPU the kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` in the
environment before this module is imported): that is how CI checks them without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention import AttentionBatch, split_by_query_len
from kernels.cpu_attention import PagedRows, key_ends
from kernels.triton_ops import rope_and_cache_write

# Read where triton reads it: when a kernel is decorated (at this module's import). Its
# own language functions (tl.sum, ...) must have been decorated under it too.
INTERPRETED = bool(triton.knobs.runtime.interpret)
LATE = INTERPRETED and isinstance(tl.sum, triton.runtime.JITFunction)
# Triton before 3.7 interprets `range(0, bound)` with a computed bound as int() of a
# 1-element array, which numpy refuses; compiled kernels (CUDA) are not affected.
OLD_INTERPRETER = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)
# Decode splits: at least this many context tokens per split, and enough splits to give a
# GPU about this many programs (two waves on an H100/H200's 132 SMs).
MIN_SPLIT_TOKENS = 256
TARGET_PROGRAMS = 264


def block_size_refused(block_size: int) -> str | None:
    """Why the kernels cannot take KV blocks of `block_size` tokens; None when they can. A
    kernel step reads one cache block as a tile: a power of two, and >= 16 for the
    tensor-core dot products."""
    if block_size < 16 or block_size & (block_size - 1):
        return f"the Triton backend needs a power-of-two block size >= 16, not {block_size}"
    return None


def available(device: torch.device, block_size: int | None = None) -> str | None:
    """None when the kernels can run on `device` with KV blocks of `block_size` tokens;
    otherwise why not."""
    why = None if block_size is None else block_size_refused(block_size)
    if why is not None:
        return why
    if device.type == "cuda":
        return None
    if device.type == "cpu" and LATE:
        return "TRITON_INTERPRET=1 was set after triton was imported: set it before start"
    if device.type == "cpu" and INTERPRETED and OLD_INTERPRETER:
        return (f"Triton {triton.__version__}'s interpreter cannot index with a scalar block "
                "(the kernels' loop bounds; fixed in 3.7): on a CPU use triton >= 3.7")  # fmt: skip
    if device.type == "cpu" and INTERPRETED:
        return None
    return f"Triton kernels run on CUDA, or on a CPU under TRITON_INTERPRET=1 (not {device})"


@triton.jit
def _decode_partial(
    q_ptr, cache_ptr, tables_ptr, rows_ptr, ctx_ptr, acc_ptr, max_ptr, sum_ptr,
    stride_qt, stride_qh, stride_ckv, stride_ch, stride_cs, stride_tb,
    stride_as, stride_ah, stride_ap, stride_ms, stride_mh,
    scale, split_len, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv
    lo = split * split_len  # a multiple of BLOCK_N: each step reads one cache block
    hi = tl.minimum(lo + split_len, ctx)
    first_key = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the window's start
    lo = tl.maximum(lo, first_key // BLOCK_N * BLOCK_N)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        block = tl.load(tables_ptr + seq * stride_tb + start // BLOCK_N).to(tl.int64)
        n_ok = (start + n < hi) & (start + n >= first_key)
        offsets = (block * BLOCK_N + n)[:, None] * stride_cs + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_base + offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc_ptr + seq * stride_as + heads[:, None] * stride_ah + split * stride_ap + d[None, :]
    tl.store(out, acc, mask=g_ok[:, None] & d_ok[None, :])
    stats = seq * stride_ms + heads * stride_mh + split
    tl.store(max_ptr + stats, m, mask=g_ok)
    tl.store(sum_ptr + stats, s_sum, mask=g_ok)


@triton.jit
def _decode_merge(
    out_ptr, rows_ptr, acc_ptr, max_ptr, sum_ptr,
    stride_ot, stride_oh, stride_as, stride_ah, stride_ap, stride_ms, stride_mh,
    num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_ok, d_ok = p < num_splits, d < HEAD_DIM
    stats = seq * stride_ms + head * stride_mh + p
    m = tl.load(max_ptr + stats, mask=p_ok, other=float("-inf"))
    s_sum = tl.load(sum_ptr + stats, mask=p_ok, other=0.0)
    acc = tl.load(
        acc_ptr + seq * stride_as + head * stride_ah + p[:, None] * stride_ap + d[None, :],
        mask=p_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    # Empty splits (max -inf) weigh 0; an empty context (a padded CUDA-graph row) gives 0.
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    den = tl.sum(w * s_sum, axis=0)
    num = tl.sum(w[:, None] * acc, axis=0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)  # fmt: skip


@triton.jit
def _extend(
    out_ptr, q_ptr, cache_ptr, tables_ptr, starts_ptr, qlens_ptr, ctx_ptr, key_ends_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ckv, stride_ch, stride_cs, stride_tb,
    scale, window, HAS_SPANS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # A tile's rows are (query row, head of the KV head's group) pairs, query-row major:
    # each K/V block is read once for the whole group, as in decode.
    seq, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(qlens_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    first = tl.load(starts_ptr + seq).to(tl.int64)
    pair = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pair // GROUP
    heads = kv_head * GROUP + pair % GROUP
    d = tl.arange(0, BLOCK_D)
    r_ok, d_ok = rows < q_len, d < HEAD_DIM
    q_mask = r_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + (first + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=q_mask, other=0.0,
    )  # fmt: skip
    position = ctx - q_len + rows  # each row sees context positions <= its own
    last_key = position  # ... or up to its span's end
    if HAS_SPANS:
        last_key = tl.load(key_ends_ptr + first + rows, mask=r_ok, other=1) - 1
    first_key = tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)
    # The tile's rows see keys up to the largest last key; a tile past the chunk's end
    # reads nothing; the first block read holds the tile's earliest window start.
    hi = tl.minimum(ctx, tl.max(tl.where(r_ok, last_key + 1, 0), axis=0))
    lo_key = tl.min(tl.where(r_ok, first_key, ctx), axis=0)
    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo_key // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        block = tl.load(tables_ptr + seq * stride_tb + start // BLOCK_N).to(tl.int64)
        n_ok = (start + n < hi) & (start + n >= lo_key)
        offsets = (block * BLOCK_N + n)[:, None] * stride_cs + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
        key = (start + n)[None, :]
        seen = n_ok[None, :] & (key <= last_key[:, None]) & (key >= first_key[:, None])
        s = tl.where(seen, s, float("-inf"))
        # A row may see nothing in a block before its window: keep its max at -inf
        # without an inf - inf.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_base + offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / tl.where(s_sum > 0, s_sum, 1.0)[:, None]
    dest = out_ptr + (first + rows)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _precision(dtype: torch.dtype) -> str:
    # float32 matmuls stay float32 (TF32 would cost the token-exact comparison with torch).
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_splits(max_context: int, num_seqs: int, num_kv_heads: int, block_size: int):
    """(num_splits, split_len): enough (sequence, KV head, split) programs to fill a GPU,
    each split at least MIN_SPLIT_TOKENS long and a whole number of cache blocks."""
    by_length = triton.cdiv(max(max_context, 1), MIN_SPLIT_TOKENS)
    by_occupancy = max(1, TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
    splits = max(1, min(by_length, by_occupancy))
    split_len = triton.cdiv(triton.cdiv(max(max_context, 1), splits), block_size) * block_size
    return triton.cdiv(max(max_context, 1), split_len), split_len


def paged_decode(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, rows: PagedRows,
    num_splits: int, split_len: int, scale: float, window: int = 0,
) -> None:  # fmt: skip
    """out[rows.query_starts[i]] = attention of that single-token query over the first
    context_lens[i] cache slots of block_tables[i]. q, out: [tokens, heads, head_dim]."""
    num_seqs = rows.context_lens.shape[0]
    if num_seqs == 0:
        return
    _, kv_heads, _, dim = kv_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads
    acc = torch.empty(num_seqs, heads, num_splits, dim, device=q.device, dtype=torch.float32)
    maxes = torch.empty(num_seqs, heads, num_splits, device=q.device, dtype=torch.float32)
    sums = torch.empty_like(maxes)
    block_d = triton.next_power_of_2(dim)
    _decode_partial[(num_seqs, kv_heads, num_splits)](
        q, kv_cache, rows.block_tables, rows.query_starts, rows.context_lens, acc, maxes, sums,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        rows.block_tables.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
        maxes.stride(0), maxes.stride(1), scale, split_len, window,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=rows.block_size,
        HEAD_DIM=dim, BLOCK_D=block_d, PRECISION=_precision(q.dtype),
    )  # fmt: skip
    _decode_merge[(num_seqs, heads)](
        out, rows.query_starts, acc, maxes, sums, out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
        num_splits, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(num_splits),
    )  # fmt: skip


def paged_extend(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, rows: PagedRows,
    max_query_len: int, scale: float, window: int = 0, key_ends: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Causal attention of each sequence's query_lens[i] rows (the last of its
    context_lens[i] positions, their K/V already in the cache) over its block table."""
    num_seqs = rows.context_lens.shape[0]
    if num_seqs == 0:
        return
    _, kv_heads, _, dim = kv_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads
    block_m = 64
    grid = (num_seqs, kv_heads, triton.cdiv(max_query_len * group, block_m))
    has_spans = key_ends is not None and key_ends.numel() > 0
    _extend[grid](
        out, q, kv_cache, rows.block_tables, rows.query_starts, rows.query_lens,
        rows.context_lens, key_ends if has_spans else rows.query_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), rows.block_tables.stride(0),
        scale, window, HAS_SPANS=has_spans, GROUP=group, BLOCK_M=block_m, BLOCK_N=rows.block_size,
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), PRECISION=_precision(q.dtype),
    )  # fmt: skip


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where the new K/V go
    decode: PagedRows | None  # single-token queries
    extend: PagedRows | None  # everything longer
    max_query_len: int  # of `extend`
    num_splits: int  # of `decode`
    split_len: int
    window: int = 0  # > 0: the sliding window
    key_ends: torch.Tensor | None = None  # [num_tokens] int32 with spans (cpu_attention)


def paged_rows(batch: AttentionBatch, members: list[int], starts: list[int]) -> PagedRows:
    """Host int32 tensors of the sequences `members` (block tables padded with block 0,
    never read: every loop stops at the context length)."""
    width = max(len(batch.block_tables[i]) for i in members)
    tables = [batch.block_tables[i] + [0] * (width - len(batch.block_tables[i])) for i in members]

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return PagedRows(
        ints(tables), ints([starts[i] for i in members]),
        ints([batch.query_lens[i] for i in members]),
        ints([batch.context_lens[i] for i in members]), batch.block_size,
    )  # fmt: skip


class TritonPagedAttention:
    """The attention backend over the Triton kernels (the torch backend's cache layout)."""

    name = "triton"

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int]:
        why = block_size_refused(block_size)
        if why is not None:
            raise ValueError(why)
        return (2, num_kv_heads, num_blocks * block_size, head_dim)

    def build_metadata(
        self, batch: AttentionBatch, slot_mapping: torch.Tensor, device: torch.device
    ) -> TritonAttentionMetadata:
        starts, decode, extend = split_by_query_len(batch)
        # A single-token query inside a span (an image's last token alone in a chunk)
        # takes the extend kernel, the one with spans.
        extend = sorted(extend + [i for i in decode if batch.seq_spans(i)])
        decode = [i for i in decode if not batch.seq_spans(i)]
        splits, split_len = 1, batch.block_size
        if decode:
            # KV heads are unknown here; one is the conservative guess (more splits).
            max_ctx = max(batch.context_lens[i] for i in decode)
            splits, split_len = decode_splits(max_ctx, len(decode), 1, batch.block_size)
        meta = TritonAttentionMetadata(
            slot_mapping,
            paged_rows(batch, decode, starts) if decode else None,
            paged_rows(batch, extend, starts) if extend else None,
            max((batch.query_lens[i] for i in extend), default=0), splits, split_len,
            batch.sliding_window or 0, key_ends(batch, starts),
        )  # fmt: skip
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kv_cache[0].index_copy_(1, metadata.slot_mapping, k.transpose(0, 1))
        kv_cache[1].index_copy_(1, metadata.slot_mapping, v.transpose(0, 1))
        return self.attend(q, kv_cache, metadata, scale)

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonAttentionMetadata, scale
    ) -> torch.Tensor:
        """The attention of every query row; the step's K/V are already in the cache."""
        out = torch.empty_like(q)
        if metadata.decode is not None:
            paged_decode(
                out, q, kv_cache, metadata.decode, metadata.num_splits, metadata.split_len, scale,
                metadata.window,
            )  # fmt: skip
        if metadata.extend is not None:
            paged_extend(
                out, q, kv_cache, metadata.extend, metadata.max_query_len, scale,
                metadata.window, metadata.key_ends,
            )  # fmt: skip
        return out

    def forward_rope(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, kv_cache: torch.Tensor, metadata: TritonAttentionMetadata, scale,
    ) -> torch.Tensor:  # fmt: skip
        """RoPE on q and k, the K/V cache write (one kernel) and attention; the decoder's
        path when its fused ops are on. A negative slot writes nothing (CUDA-graph pads)."""
        rope_and_cache_write(q, k, v, cos, sin, metadata.slot_mapping, kv_cache)
        return self.attend(q, kv_cache, metadata, scale)

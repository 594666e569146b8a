"""The C++ prefill/extend attention kernel (kernels/csrc/prefill_attention_cpu.cpp) against
a plain-torch float64 softmax(QK^T)V over each sequence's own K/V, and the CPU backend's
routing of long queries to it."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention
from kernels.attention import AttentionBatch
from kernels.backends import select_backend


@pytest.fixture(autouse=True)
def needs_the_cpu_kernels():
    """They build on first use (20 s to a minute): when a test here runs, never at
    collection, so `pytest -m gpu` on a GPU machine does not build them."""
    why = cpu_attention.prefill_available() or cpu_attention.available()
    if why is not None:
        pytest.skip(f"the CPU kernels did not build: {why}")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, H, D], the last q_len positions of a context with k, v: [ctx, KVH, D];
    computed in float64 with explicit matmuls (no SDPA)."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    group = heads // kv_heads
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))  # [heads, len, D]
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale  # [H, q_len, ctx]
    allowed = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + (ctx - q_len)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ vd).transpose(0, 1)


def paged_problem(shapes, heads, kv_heads, dim, block, dtype=torch.float32, seed=0):
    """Sequences (cached, new) on a cache of scattered blocks whose every unused slot (and
    every slot of a sequence past its context) holds NaN: reading one poisons the output.
    Returns the per-sequence q/k/v, the cache, and the flat q of the new tokens, taken as a
    strided view of a wider qkv-like tensor as the decoder passes it."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block) for c, n in shapes) + 6
    cache = torch.full((2, kv_heads, num_blocks * block, dim), float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // block))] for c, n in shapes]
    seqs = []
    for (c, n), table in zip(shapes, tables, strict=True):
        q, k, v = (torch.randn(c + n, h, dim, generator=gen).to(dtype) for h in
                   (heads, kv_heads, kv_heads))  # fmt: skip
        slots = torch.tensor([table[p // block] * block + p % block for p in range(c + n)])
        cache[0][:, slots], cache[1][:, slots] = k.transpose(0, 1), v.transpose(0, 1)
        seqs.append((q[c:], k, v))
    total = sum(n for _, n in shapes)
    wide = torch.zeros(total, heads + 3, dim, dtype=dtype)  # rows wider than q: strided q
    wide[:, :heads] = torch.cat([q for q, _, _ in seqs])
    batch = AttentionBatch([n for _, n in shapes], [c + n for c, n in shapes], tables, block)
    return seqs, cache, wide[:, :heads], batch


def run_kernel(shapes, heads, kv_heads, dim, block, dtype=torch.float32, seed=0):
    seqs, cache, q, batch = paged_problem(shapes, heads, kv_heads, dim, block, dtype, seed)
    starts = [sum(batch.query_lens[:i]) for i in range(len(shapes))]
    rows = cpu_attention.paged_rows(batch, starts, list(range(len(shapes))))
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    torch.ops.vlmserve_prefill.prefill_attention(
        out, q, cache, rows.block_tables, rows.query_starts, rows.query_lens,
        rows.context_lens, block, dim**-0.5,
    )  # fmt: skip
    return seqs, out


# (cached, new): fresh prompts, chunks on a prefix, lengths around the 64-key tiles and
# the query blocks, a block-aligned and a one-token prefix.
RAGGED = [(0, 17), (0, 130), (45, 20), (64, 64), (1, 97), (200, 33), (0, 64), (31, 150)]


@pytest.mark.slow
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (8, 2)])  # GQA groups 1, 2, 4
@pytest.mark.parametrize("block", [16, 32])
def test_ragged_fresh_and_extend_match_reference(heads, kv_heads, dim, block):
    seqs, out = run_kernel(RAGGED, heads, kv_heads, dim, block, seed=heads + dim + block)
    start = 0
    for q, k, v in seqs:
        expected = reference(q, k, v, dim**-0.5).float()
        torch.testing.assert_close(out[start : start + len(q)], expected, rtol=1e-4, atol=1e-5)
        start += len(q)


@pytest.mark.parametrize(
    "dtype, dim, tol",
    [(torch.float32, 80, 1e-5), (torch.float32, 8, 1e-5), (torch.bfloat16, 64, 2e-2)],
)
def test_other_head_dims_and_dtypes_match_reference(dtype, dim, tol):
    """Head dims that are not a multiple of 16 and non-float32 caches take the copying path."""
    shapes = [(0, 40), (70, 25), (5, 100)]
    seqs, out = run_kernel(shapes, 6, 2, dim, 16, dtype)
    start = 0
    for q, k, v in seqs:
        expected = reference(q, k, v, dim**-0.5).to(dtype)
        torch.testing.assert_close(out[start : start + len(q)], expected, rtol=tol, atol=tol)
        start += len(q)


@pytest.mark.parametrize("dim, block", [(256, 16), (64, 32), (96, 4), (128, 48)])
def test_bfloat16_at_head_dims_a_multiple_of_32_match_reference(dim, block):
    """The AMX path where the CPU has it (`amx_available()`), else the dot-product one: key
    tiles read in place from 16- and 48-slot blocks, gathered from 4-slot ones; query
    blocks of 1 and 2 row tiles (GQA 4 and 6), ragged lengths around the 16- and 64-key
    tiles. The tolerance is bfloat16's on q, k, v and the rounded probabilities."""
    for heads, kv_heads in ((4, 1), (6, 1)):
        seqs, out = run_kernel(RAGGED, heads, kv_heads, dim, block, torch.bfloat16, seed=dim)
        start = 0
        for q, k, v in seqs:
            expected = reference(q, k, v, dim**-0.5).float()
            got = out[start : start + len(q)].float()
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
            start += len(q)


def test_large_scores_stay_finite():
    """Scores of +-100 (e^100 overflows float32) must not overflow the online softmax; the
    tolerance is float32's on scores that large."""
    seqs, cache, q, batch = paged_problem([(10, 50)], 4, 2, 64, 16)
    q.mul_(30.0)
    seqs[0] = (seqs[0][0] * 30.0, *seqs[0][1:])
    starts = [0]
    rows = cpu_attention.paged_rows(batch, starts, [0])
    out = torch.empty(q.shape)
    torch.ops.vlmserve_prefill.prefill_attention(
        out, q, cache, rows.block_tables, rows.query_starts, rows.query_lens,
        rows.context_lens, 16, 64**-0.5,
    )  # fmt: skip
    expected = reference(*seqs[0], 64**-0.5).float()
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)


def test_backend_routes_long_queries_to_the_kernel_and_sdpa_stays_selectable():
    batch = AttentionBatch([1, 40, 20], [30, 40, 60], [[0, 1], [2, 3, 4], [5, 6, 7, 8]], 16)
    slots = torch.arange(61)
    meta = select_backend(torch.device("cpu")).build_metadata(batch, slots, torch.device("cpu"))
    assert meta.prefill.query_lens.tolist() == [40, 20] and meta.paged.query_lens.tolist() == [1]
    assert meta.fresh == [] and meta.groups == []
    sdpa = select_backend(torch.device("cpu"), "cpu-sdpa")
    assert sdpa.name == "cpu-sdpa"
    meta = sdpa.build_metadata(batch, slots, torch.device("cpu"))
    assert meta.prefill is None and meta.fresh == [(1, 41)] and len(meta.groups) == 1

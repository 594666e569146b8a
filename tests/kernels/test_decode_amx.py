"""The decode kernel's AMX path (kernels/csrc/paged_amx.h: S^T = K Q^T on tiles with the
keys read in place, P V on tiles) against float64 attention of the same bfloat16 values,
within the bound the prefill kernel's bfloat16 paths meet (one output rounding, one
rounding of every probability). The cache is poisoned where no row may look: NaN in every
unused slot, past each context and before the window (the block that straddles its start
included: the path reads keys there as whole tiles, but must zero those values, which the
vector path multiplies by a zero probability).
Runs where the CPU has AMX (`amx_bf16`) and the kernels build."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention
from tests.kernels.test_prefill_attention import paged_problem

BF16 = torch.bfloat16
HALF_ULP = 2.0**-8


@pytest.fixture(autouse=True)
def amx_kernel():
    if cpu_attention.available() is not None or not cpu_attention.amx_available():
        pytest.skip("no AMX here (or the CPU attention kernels did not build)")


def windowed_reference(q, k, v, scale, window):
    """float64 attention of q [q_len, H, D] (the last q_len positions) over k, v [ctx,
    KVH, D], causal and, with a window, keys > position - window; also over |v|."""
    q_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))
    kd, vd = (x.repeat_interleave(heads // kv_heads, 0) for x in (kd, vd))
    pos = torch.arange(q_len)[:, None] + (ctx - q_len)
    keys = torch.arange(ctx)[None, :]
    allowed = (keys <= pos) & ((keys > pos - window) if window else True)
    probs = (qd @ kd.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ vd).transpose(0, 1), (probs @ vd.abs()).transpose(0, 1)


def run(shapes, heads, kv_heads, dim, block, window=0, threads=2, seed=3):
    """The decode kernel over every sequence of `shapes` on both paths: (seqs, starts,
    AMX output, vector output)."""
    seqs, cache, q, batch = paged_problem(shapes, heads, kv_heads, dim, block, BF16, seed)
    for (rows_q, k, _), table in zip(seqs, batch.block_tables, strict=True):
        lo = len(k) - len(rows_q) - window + 1 if window else 0  # the first row's window start
        for p in range(max(0, lo)):
            cache[:, :, table[p // block] * block + p % block] = float("nan")
    starts = [sum(batch.query_lens[:i]) for i in range(len(shapes))]
    rows = cpu_attention.paged_rows(batch, starts, list(range(len(shapes))))
    outs = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for amx in (True, False):
            out = torch.full(q.shape, float("nan"), dtype=BF16)
            torch.ops.vlmserve.paged_attention(
                out, q, cache, rows.block_tables, rows.query_starts, rows.query_lens,
                rows.context_lens, block, dim**-0.5, window, amx,
            )  # fmt: skip
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    return seqs, starts, *outs


def check(seqs, starts, out, dim, window):
    for (q, k, v), start in zip(seqs, starts, strict=True):
        exact, weighted = windowed_reference(q, k, v, dim**-0.5, window)
        got = out[start : start + len(q)].double()
        bound = 2 * HALF_ULP * exact.abs() + HALF_ULP * weighted + 1e-5
        assert ((got - exact).abs() <= bound).all(), (got - exact).abs().max()


# (cached, new): decodes shorter than, at and around a tile of 16 keys and a step of 32,
# a long one, verifications of 4 tokens.
DECODES = [(0, 1), (14, 1), (15, 1), (30, 1), (31, 1), (32, 1), (40, 1), (299, 1)]
VERIFY = [(60, 4), (17, 4)]


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (12, 4), (2, 2), (16, 1)])
def test_amx_decode_matches_float64_attention(heads, kv_heads, dim, block):
    """Every query-heads-per-KV-head ratio up to 16 (Gemma 3 270M's 4:1, 3:1, MHA, 16:1);
    with 16:1 a 4-token verification is 64 rows and takes the vector path in the same call."""
    seqs, starts, amx, vector = run(DECODES + VERIFY, heads, kv_heads, dim, block)
    check(seqs, starts, amx, dim, 0)
    assert not torch.equal(amx, vector)  # the AMX path ran: P rounded to bfloat16 there


@pytest.mark.parametrize("window", [7, 20, 64])
def test_amx_decode_within_a_sliding_window(window):
    shapes = [(100, 1), (33, 1), (5, 1), (70, 4), (300, 1)]
    seqs, starts, amx, _ = run(shapes, 4, 1, 256, 16, window=window)
    check(seqs, starts, amx, 256, window)


@pytest.mark.parametrize("window", [0, 50])
def test_amx_decode_of_one_sequence_split_across_threads(window):
    """One sequence and one KV head with two threads: its blocks in shares, merged
    (flash-decoding): the path's running max must come back in natural units."""
    seqs, starts, amx, _ = run([(700, 1)], 4, 1, 256, 16, window=window)
    check(seqs, starts, amx, 256, window)

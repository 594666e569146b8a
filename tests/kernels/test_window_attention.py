"""Sliding-window and bidirectional-span attention (Gemma 3) in every CPU-runnable backend
against a plain-torch reference over each sequence's own K/V, on random paged layouts.
Slots a backend must not read are poisoned: NaN in whole blocks before a sequence's
window (a hybrid KV pool may have handed them to another sequence) and past its context;
huge values in the rest of the window-straddling block (read there, but masked out)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import attention, cpu_attention
from kernels.attention import AttentionBatch, TorchPagedAttention
from kernels.backends import select_backend

HEADS, KV_HEADS, BLOCK, NUM_BLOCKS = 4, 2, 4, 160


def reference_mask(q_pos: list[int], ctx: int, window, spans) -> torch.Tensor:
    """[len(q_pos), ctx] bool, element by element from the rule's words: causal or both in
    one span, and (with a window) key > query - window."""
    mask = torch.zeros(len(q_pos), ctx, dtype=torch.bool)
    for i, qp in enumerate(q_pos):
        for kp in range(ctx):
            ok = kp <= qp or any(s <= qp < e and s <= kp < e for s, e in spans)
            mask[i, kp] = ok and (window is None or kp > qp - window)
    return mask


def cpu_backend():
    why = cpu_attention.available() or cpu_attention.prefill_available()
    if why is not None:
        pytest.skip(f"the C++ CPU kernels did not build here: {why}")
    return cpu_attention.CpuPagedAttention()


def triton_backend():
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton runs on a CPU only under TRITON_INTERPRET=1")
    from kernels import triton_attention

    return triton_attention.TritonPagedAttention()


BACKENDS = {
    "torch": TorchPagedAttention,
    "cpu": cpu_backend,
    "cpu-sdpa": lambda: (cpu_backend(), select_backend(torch.device("cpu"), "cpu-sdpa"))[1],
    "triton": triton_backend,
}

# (cached context before the step, new tokens, spans as absolute [start, end) inside the
# new tokens): decodes far past the window, a verification, a chunk crossing the window
# edge, fresh prefills with and without an image span, a chunk with two spans on a
# prefix, a short chunk that is one span (the prefill kernel's, whatever its length).
LAYOUT = [
    (99, 1, []),
    (5, 1, []),
    (40, 5, []),
    (30, 40, []),
    (0, 37, []),
    (0, 45, [(9, 25)]),
    (21, 50, [(30, 46), (50, 66)]),
    (60, 16, [(60, 76)]),
    (17, 1, []),
]


@pytest.mark.parametrize("null", [False, True], ids=["own-blocks", "null-block"])
@pytest.mark.parametrize("window", [16, 7, None])
@pytest.mark.parametrize("dim", [8, 32])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_window_and_spans_match_the_reference(backend, dim, window, null):
    """`null`: the tables a hybrid KV pool sends (scheduler/kv_blocks.py): every entry
    wholly before a sequence's first window is the null block (0, shared by all of them),
    and the blocks those entries held went back to the pool (another sequence may write
    them). Both are poisoned with NaN: no backend may read either."""
    if backend == "triton" and dim == 8:
        pytest.skip("Triton's tiles need a head dim of at least 16")
    if null and window is None:
        pytest.skip("only a sliding window releases blocks")
    run_layout(backend, dim, window, torch.float32, atol=2e-5, rtol=1e-4, null=null)


@pytest.mark.parametrize("null", [False, True], ids=["own-blocks", "null-block"])
@pytest.mark.parametrize("window", [16, 7, None])
@pytest.mark.parametrize("dim", [8, 32])
def test_window_and_spans_in_bf16_on_the_cpu_kernels(dim, window, null):
    """bfloat16 q and cache: head dim 32 takes the prefill kernel's AVX-512 BF16
    dot-product path where the CPU has it (8 the widening one); the poisoned slots must
    stay unread there too. Bound: the output's rounding and each probability's (bf16)."""
    if null and window is None:
        pytest.skip("only a sliding window releases blocks")
    run_layout("cpu", dim, window, torch.bfloat16, atol=1e-2, rtol=2.0**-7, null=null)


@pytest.mark.parametrize("null", [False, True], ids=["own-blocks", "null-block"])
@pytest.mark.parametrize("window", [16, 7, None])
@pytest.mark.parametrize("rows", [5, 8])
@pytest.mark.parametrize("backend", ["torch", "cpu-sdpa"])
def test_sdpa_in_query_blocks_matches_the_reference(backend, rows, window, null, monkeypatch):
    """A long chunk's SDPA in blocks of `rows` queries, each over only the keys it reads
    (plain causal ones without a mask): the layout's chunks span several blocks."""
    if null and window is None:
        pytest.skip("only a sliding window releases blocks")
    monkeypatch.setattr(attention, "SDPA_QUERY_BLOCK", rows)
    run_layout(backend, 32, window, torch.float32, atol=2e-5, rtol=1e-4, null=null)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 64, 37])
@pytest.mark.parametrize("threads", [3, 4, 8])
def test_a_lone_long_decode_split_over_threads(threads, window, dtype):
    """Fewer (sequence, KV head) items (here 2 or 4) than threads: the CPU kernel splits each item's
    blocks into shares and merges their softmax sums; every share's range (the window's
    start included, NaN-poisoned blocks before it) must still give the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layout = [(213, 1, []), (150, 1, [])] if threads == 8 else [(201, 1, [])]
        tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {
            "atol": 1e-2, "rtol": 2.0**-7}  # fmt: skip
        run_layout("cpu", 32, window, dtype, null=window is not None, layout=layout, **tol)
    finally:
        torch.set_num_threads(before)


def run_layout(
    backend: str, dim: int, window, dtype: torch.dtype, atol: float, rtol: float,
    null: bool = False, layout=LAYOUT,
):  # fmt: skip
    torch.manual_seed(dim + (window or 0))
    attn = BACKENDS[backend]()
    block = 16 if backend == "triton" else BLOCK  # Triton reads a block as one tile
    device = torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    shape = attn.kv_cache_shape(NUM_BLOCKS, block, KV_HEADS, dim)
    cache = torch.randn(shape).to(dtype)
    # Blocks at random pages; block 0 stays out (the null block of the `null` tables).
    free = (torch.randperm(NUM_BLOCKS - 1) + 1).tolist()
    tables, seqs, poison = [], [], []
    for cached, new, spans in layout:
        ctx = cached + new
        table = [free.pop() for _ in range((ctx + block - 1) // block)]
        k, v = torch.randn(2, ctx, KV_HEADS, dim).to(dtype)
        for which, x in ((0, k), (1, v)):  # the whole context is in the cache
            write(cache, which, table, range(ctx), x, block)
        lo = 0 if window is None else max(0, cached - window + 1)  # first query's window
        nan = torch.full((block, KV_HEADS, dim), float("nan"), dtype=dtype)
        for b in range(lo // block if null else 0):  # released: poisoned, the null block
            for which in (0, 1):
                write(cache, which, [table[b]], range(block), nan, block)
            table[b] = 0
        for pos in range(lo // block * block, lo):  # the straddling block: read, masked
            poison.append((table, pos, 1e4))
        for pos in range(lo // block * block):  # whole blocks before it: never read
            poison.append((table, pos, float("nan")))
        for pos in range(ctx, len(table) * block):  # past the context
            poison.append((table, pos, float("nan")))
        tables.append(table)
        seqs.append((cached, new, spans, k, v))
    for table, pos, value in poison:
        for which in (0, 1):
            write(cache, which, table, [pos], torch.full((1, KV_HEADS, dim), value, dtype=dtype),
                  block)  # fmt: skip
    q = torch.randn(sum(new for _, new, _, _, _ in seqs), HEADS, dim).to(dtype)
    k_new = torch.cat([k[c:] for c, _, _, k, _ in seqs])
    v_new = torch.cat([v[c:] for c, _, _, _, v in seqs])
    slots = [
        t[p // block] * block + p % block
        for t, (c, n, _, _, _) in zip(tables, seqs, strict=True)
        for p in range(c, c + n)
    ]
    batch = AttentionBatch(
        [n for _, n, _, _, _ in seqs], [c + n for c, n, _, _, _ in seqs], tables, block,
        sliding_window=window, spans=[s for _, _, s, _, _ in seqs],
    )  # fmt: skip
    meta = attn.build_metadata(batch, torch.tensor(slots), device)
    out = attn.forward(*(x.to(device) for x in (q, k_new, v_new)), cache.to(device), meta, 0.3)
    out = out.cpu()
    row = 0
    for cached, new, spans, k, v in seqs:
        mask = reference_mask(list(range(cached, cached + new)), cached + new, window, spans)
        ref = F.scaled_dot_product_attention(
            q[row : row + new].float().transpose(0, 1), k.float().transpose(0, 1),
            v.float().transpose(0, 1), attn_mask=mask, scale=0.3, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(out[row : row + new].float(), ref, atol=atol, rtol=rtol)
        row += new


def write(cache: torch.Tensor, which: int, table, positions, x: torch.Tensor, block: int) -> None:
    """x [len(positions), kv_heads, dim] into the cache slots of `positions` (every
    CPU-runnable backend has the torch layout)."""
    for i, pos in enumerate(positions):
        slot = table[pos // block] * block + pos % block
        cache[which, :, slot] = x[i]


def test_the_mask_differs_from_causal_where_it_should():
    """The reference rule itself: a window hides old keys, a span shows later ones."""
    mask = reference_mask([10, 12], 20, 4, [(11, 15)])
    assert mask[0].nonzero().flatten().tolist() == [7, 8, 9, 10]
    assert mask[1].nonzero().flatten().tolist() == [9, 10, 11, 12, 13, 14]

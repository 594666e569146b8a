"""Every attention backend against plain SDPA over each sequence's own K/V. One helper,
run on CPU always (the torch reference and the C++ CPU kernel) and on CUDA where there is
one, so the GPU check can never drift from the layout the runner allocates
(`backend.kv_cache_shape`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_attention
from kernels.attention import AttentionBatch, TorchPagedAttention, _buckets
from kernels.backends import select_backend

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 128
# Per sequence: (tokens cached by step 1, new tokens in step 2). Step 1 prefills the
# prefixes (fresh: short ones in the padded group, long ones by SDPA); step 2 mixes a
# long chunk on top of a prefix, a fresh prefill, decodes over short and long contexts,
# and a 5-row verification.
SHAPES = [(10, 23), (0, 17), (30, 1), (3, 1), (12, 5), (57, 1), (100, 1)]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, H, D], the last q_len positions of a context with k, v: [ctx, KVH, D]."""
    q_len, ctx = q.shape[0], k.shape[0]
    allowed = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + (ctx - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=allowed.to(q.device), scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


def cpu_backend():
    why = cpu_attention.available() or cpu_attention.prefill_available()
    if why is not None:
        pytest.skip(f"the C++ CPU kernel did not build here: {why}")
    return cpu_attention.CpuPagedAttention()


BACKENDS = {"torch": TorchPagedAttention, "cpu": cpu_backend}
# The C++ decode kernel with the torch path (SDPA) for prefills: the opt-out of the kernel.
WITH_SDPA = {**BACKENDS, "cpu-sdpa": lambda: select_backend(torch.device("cpu"), "cpu-sdpa")}


def run_step(
    backend, cache: torch.Tensor, tables: list[list[int]],
    spans: list[tuple[int, int]], qkv: list[tuple[torch.Tensor, ...]], block: int = BLOCK,
) -> None:  # fmt: skip
    """One step: sequence i computes positions spans[i] = (start, end) over its full q, k,
    v in `qkv`; checks every output row against `reference`."""
    rows = [(i, s, e) for i, (s, e) in enumerate(spans) if e > s]
    q, k, v = (torch.cat([qkv[i][j][s:e] for i, s, e in rows]) for j in range(3))
    slot_mapping = torch.tensor(
        [tables[i][p // block] * block + p % block for i, s, e in rows for p in range(s, e)]
    )
    batch = AttentionBatch(
        query_lens=[e - s for _, s, e in rows], context_lens=[e for _, _, e in rows],
        block_tables=[tables[i] for i, _, _ in rows], block_size=block,
    )  # fmt: skip
    meta = backend.build_metadata(batch, slot_mapping, cache.device)
    dim = q.shape[-1]
    out = backend.forward(q, k, v, cache, meta, scale=dim**-0.5)
    start = 0
    for i, s, e in rows:
        sq, sk, sv = qkv[i]
        expected = reference(sq[s:e].float(), sk[:e].float(), sv[:e].float(), dim**-0.5)
        tol = 1e-4 if q.dtype == torch.float32 else 1e-2  # 16-bit: the output's rounding
        got = out[start : start + e - s].float()
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        start += e - s


def check_paged_attention(
    device: torch.device, heads: int = HEADS, kv_heads: int = KV_HEADS, block: int = BLOCK,
    backend=None, shapes=SHAPES, dim: int = DIM, seed: int = 0, fill: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> None:  # fmt: skip
    """Two steps on a paged cache with scattered blocks: step 1 writes the prefixes, step 2
    reads them back through the block tables. `fill`: the unwritten slots' value (NaN:
    any read outside a block table's context shows in the output)."""
    gen = torch.Generator().manual_seed(seed)
    backend = backend or TorchPagedAttention()
    num_blocks = max(NUM_BLOCKS, sum(-(-(c + n) // block) for c, n in shapes) + 8)
    shape = backend.kv_cache_shape(num_blocks, block, kv_heads, dim)
    cache = torch.full(shape, fill, device=device, dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous blocks
    tables = [[free.pop() for _ in range(-(-(c + n) // block))] for c, n in shapes]
    qkv = [
        tuple(torch.randn(c + n, h, dim, generator=gen).to(device, dtype)
              for h in (heads, kv_heads, kv_heads))
        for c, n in shapes
    ]  # fmt: skip
    run_step(backend, cache, tables, [(0, c) for c, _ in shapes], qkv, block)
    run_step(backend, cache, tables, [(c, c + n) for c, n in shapes], qkv, block)


@pytest.mark.parametrize("backend", WITH_SDPA)
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])  # GQA and MHA
def test_block_sizes_gqa_and_mha_match_sdpa(heads, kv_heads, block, backend):
    check_paged_attention(torch.device("cpu"), heads, kv_heads, block, WITH_SDPA[backend]())


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(12, 4), (8, 1), (6, 6)])
def test_random_paged_layouts_match_sdpa(heads, kv_heads, block, seed, backend):
    """Ragged random batches at the serving head size (64): many decodes over contexts of
    1 to 700 tokens (block boundaries, single-token contexts), verifications of 2-16 rows,
    a fresh prefill and a long chunk on a prefix, all in one step."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    shapes = [(draw(0, 700), 1) for _ in range(24)] + [(0, 1), (block - 1, 1), (block, 1)]
    shapes += [(draw(1, 300), draw(2, 16)) for _ in range(4)] + [(0, 40), (draw(1, 90), 33)]
    check_paged_attention(
        torch.device("cpu"), heads, kv_heads, block, BACKENDS[backend](), shapes, 64, seed
    )


def test_cpu_kernel_is_the_cpu_default_and_torch_stays_selectable():
    cpu_backend()
    assert select_backend(torch.device("cpu")).name == "cpu"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"
    assert select_backend(torch.device("cpu"), "cpu-sdpa").name == "cpu-sdpa"
    with pytest.raises(ValueError, match="not one of"):
        select_backend(torch.device("cpu"), "flash")
    with pytest.raises(ValueError, match="flashinfer"):
        select_backend(torch.device("cpu"), "flashinfer")  # GPU-only


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # fmt: skip
def test_mixed_steps_match_sdpa_per_sequence(device):
    check_paged_attention(torch.device(device))


def test_buckets_bound_padding_waste():
    lens = [5, 500, 7, 480, 6, 1000, 490]
    groups = _buckets(list(range(len(lens))), lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert max(lens[i] for i in g) * len(g) <= 1.3 * sum(lens[i] for i in g)
    assert len(groups) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_decode_kernel_gives_the_same_either_prefetch(dtype):
    """The vector path's two prefetches of the next block (by lines or whole: calibrated
    per CPU, `decode_spread_wins`) only move bytes into the cache: bit-identical outputs,
    equal to the reference, on scattered 16-token blocks of head dim 256 whose unused
    slots hold NaN (decodes over one to many blocks, a 4-row verification, one thread and
    two: a context split into shares)."""
    from tests.kernels.test_prefill_attention import paged_problem

    cpu_backend()
    shapes = [(0, 1), (15, 1), (16, 1), (47, 1), (300, 1), (60, 4)]
    seqs, cache, q, batch = paged_problem(shapes, 4, 1, 256, 16, dtype, seed=5)
    starts = [sum(batch.query_lens[:i]) for i in range(len(shapes))]
    rows = cpu_attention.paged_rows(batch, starts, list(range(len(shapes))))
    before = torch.get_num_threads()
    outs = []
    try:
        for threads, spread in ((2, True), (2, False), (1, True), (1, False)):
            torch.set_num_threads(threads)
            out = torch.full(q.shape, float("nan"), dtype=dtype)
            torch.ops.vlmserve.paged_attention(
                out, q, cache, rows.block_tables, rows.query_starts, rows.query_lens,
                rows.context_lens, 16, 256**-0.5, 0, False, spread,
            )  # fmt: skip
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for (rows_q, k, v), start in zip(seqs, starts, strict=True):
        ref = reference(rows_q.float(), k.float(), v.float(), 256**-0.5)
        got = outs[0][start : start + len(rows_q)].float()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)

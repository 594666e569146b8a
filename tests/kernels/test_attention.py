"""The paged torch backend against plain SDPA over each sequence's own K/V. One helper,
run on CPU always and on CUDA where there is one, so the GPU check can never drift from
the layout the runner allocates (`backend.kv_cache_shape`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import AttentionBatch, TorchPagedAttention, _buckets

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


def run_step(
    backend: TorchPagedAttention, cache: torch.Tensor, tables: list[list[int]],
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
    out = backend.forward(q, k, v, cache, meta, scale=DIM**-0.5)
    start = 0
    for i, s, e in rows:
        sq, sk, sv = qkv[i]
        expected = reference(sq[s:e], sk[:e], sv[:e], DIM**-0.5)
        torch.testing.assert_close(out[start : start + e - s], expected, rtol=1e-4, atol=1e-4)
        start += e - s


def check_paged_attention(
    device: torch.device, heads: int = HEADS, kv_heads: int = KV_HEADS, block: int = BLOCK
) -> None:
    """Two steps on a paged cache with scattered blocks: step 1 writes the prefixes, step 2
    reads them back through the block tables."""
    gen = torch.Generator().manual_seed(0)
    backend = TorchPagedAttention()
    shape = backend.kv_cache_shape(NUM_BLOCKS, block, kv_heads, DIM)
    cache = torch.zeros(shape, device=device)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # non-contiguous blocks
    tables = [[free.pop() for _ in range(-(-(c + n) // block))] for c, n in SHAPES]
    qkv = [
        tuple(torch.randn(c + n, h, DIM, generator=gen).to(device)
              for h in (heads, kv_heads, kv_heads))
        for c, n in SHAPES
    ]  # fmt: skip
    run_step(backend, cache, tables, [(0, c) for c, _ in SHAPES], qkv, block)
    run_step(backend, cache, tables, [(c, c + n) for c, n in SHAPES], qkv, block)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])  # GQA and MHA
def test_block_sizes_gqa_and_mha_match_sdpa(heads, kv_heads, block):
    check_paged_attention(torch.device("cpu"), heads, kv_heads, block)


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

"""The paged torch backend against plain causal attention over contiguous K/V."""

from __future__ import annotations

import torch

from kernels.attention import AttentionBatch, TorchPagedAttention, _buckets


def reference(q, k, v, scale):
    # q: [q_len, H, D]; k, v: [ctx, KVH, D]; q rows are the last q_len positions of ctx.
    q_len, ctx = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + (ctx - q_len)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_mixed_step_matches_contiguous_attention():
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    num_blocks = 64
    cache = torch.zeros(2, kv_heads, num_blocks * block, dim)
    backend = TorchPagedAttention()
    # (cached tokens already in the cache, new query tokens this step): a long prefill
    # chunk on top of a prefix, a fresh prefill, decodes, and a 5-row verification.
    shapes = [(10, 23), (0, 17), (30, 1), (3, 1), (12, 5), (57, 1)]
    free = list(torch.randperm(num_blocks).tolist())  # scattered, non-contiguous blocks
    tables, full_k, full_v = [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block))]
        tables.append(table)
        k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
        full_k.append(k)
        full_v.append(v)
        for p in range(cached):  # write the already-cached part directly
            slot = table[p // block] * block + p % block
            cache[0, :, slot], cache[1, :, slot] = k[p], v[p]
    q = torch.randn(sum(n for _, n in shapes), heads, dim)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    slot_mapping = torch.cat(
        [
            torch.tensor([t[p // block] * block + p % block for p in range(c, c + n)])
            for t, (c, n) in zip(tables, shapes, strict=True)
        ]
    )
    batch = AttentionBatch(
        query_lens=[n for _, n in shapes],
        context_lens=[c + n for c, n in shapes],
        block_tables=tables,
        block_size=block,
    )
    meta = backend.build_metadata(batch, slot_mapping, torch.device("cpu"))
    out = backend.forward(q, k_new, v_new, cache, meta, scale=dim**-0.5)
    start = 0
    for (_, new), k, v in zip(shapes, full_k, full_v, strict=True):
        expected = reference(q[start : start + new], k, v, dim**-0.5)
        torch.testing.assert_close(out[start : start + new], expected, rtol=1e-5, atol=1e-5)
        start += new


def test_buckets_bound_padding_waste():
    lens = [5, 500, 7, 480, 6, 1000, 490]
    groups = _buckets(list(range(len(lens))), lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert max(lens[i] for i in g) * len(g) <= 1.3 * sum(lens[i] for i in g)
    assert len(groups) == 3

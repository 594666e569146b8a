"""Decode attention over the paged KV cache: the torch backend against gather + SDPA.

One layer of the offline-throughput model's decode step (12 query / 4 KV heads, head dim
64, 16-token blocks scattered over the cache): 64 sequences, one query token each, with
contexts drawn from 300-1200 tokens. The baseline is the straightforward plain-torch way,
the backend before it was rewritten: per context bucket, index the cache by slot (a fresh
tensor each call) and call SDPA with `enable_gqa` and a boolean mask. Outputs are checked
equal before timing; medians over --repeat calls.

    .venv/bin/python -m benchmarks.ops.paged_attention
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.lib.common import median_time, table, write_result
from kernels.attention import AttentionBatch, TorchAttentionMetadata, TorchPagedAttention


def decode_step(args: argparse.Namespace):
    gen = torch.Generator().manual_seed(args.seed)
    block = args.block_size
    ctx = torch.randint(args.min_context, args.max_context + 1, (args.seqs,), generator=gen)
    ctx = ctx.tolist()
    num_blocks = sum(-(-c // block) for c in ctx) + 8
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
    tables = []
    for c in ctx:
        tables.append(order[: -(-c // block)])
        order = order[len(tables[-1]) :]
    cache = torch.randn(2, args.kv_heads, num_blocks * block, args.head_dim, generator=gen)
    q = torch.randn(args.seqs, args.heads, args.head_dim, generator=gen)
    k, v = (torch.randn(args.seqs, args.kv_heads, args.head_dim, generator=gen) for _ in "kv")
    last = [t[(c - 1) // block] * block + (c - 1) % block for t, c in zip(tables, ctx, strict=True)]
    batch = AttentionBatch([1] * args.seqs, ctx, tables, block)
    return q, k, v, cache, batch, torch.tensor(last)


def gather_sdpa(q, k, v, cache: torch.Tensor, meta: TorchAttentionMetadata, scale: float):
    """Baseline: slot-indexed gather into new tensors, SDPA with GQA and a bool mask."""
    cache[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    cache[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)
    for g in meta.groups:
        keys = cache[0][:, g.ctx_slots].transpose(0, 1)  # [S, KVH, C, D]
        values = cache[1][:, g.ctx_slots].transpose(0, 1)
        rows = q[g.q_index].transpose(1, 2)  # [S, H, Qm, D]
        mask = (g.bias == 0).squeeze(2)[:, None]  # [S, 1, Qm, C]
        o = F.scaled_dot_product_attention(
            rows, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[g.q_index[g.q_valid]] = o.transpose(1, 2)[g.q_valid]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--min-context", type=int, default=300)
    p.add_argument("--max-context", type=int, default=1200)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    q, k, v, cache, batch, slots = decode_step(args)
    backend = TorchPagedAttention()
    meta = backend.build_metadata(batch, slots, torch.device("cpu"))
    scale = args.head_dim**-0.5
    ours = backend.forward(q, k, v, cache, meta, scale)
    torch.testing.assert_close(ours, gather_sdpa(q, k, v, cache, meta, scale))
    rows = []
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        base = median_time(lambda: gather_sdpa(q, k, v, cache, meta, scale), args.repeat)
        new = median_time(lambda: backend.forward(q, k, v, cache, meta, scale), args.repeat)
        rows.append({"threads": threads, "gather_sdpa_ms": 1e3 * base,
                     "torch_backend_ms": 1e3 * new, "speedup": base / new})  # fmt: skip
    print(table(rows, ["threads", "gather_sdpa_ms", "torch_backend_ms", "speedup"]))
    path = write_result("paged_attention", {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

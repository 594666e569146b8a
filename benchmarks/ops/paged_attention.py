"""Decode attention over the paged KV cache: the torch backend against gather + SDPA.

One layer of the offline-throughput model's decode step (12 query / 4 KV heads, head dim
64, 16-token blocks scattered over the cache): 64 sequences, one query token each, with
contexts drawn from 300-1200 tokens. The baseline is the straightforward plain-torch way,
the backend before it was rewritten: per context bucket, index the cache by slot (a fresh
tensor each call) and call SDPA with `enable_gqa` and a boolean mask. Outputs are checked
equal before timing; medians over --repeat calls.

    .venv/bin/python -m benchmarks.ops.paged_attention

--amx: the decode kernel's AMX path against its vector path (bfloat16, `amx=True/False`
of the same op) at Gemma 3 270M's shape (4 query / 1 KV head of dim 256), 64 sequences,
one cache per layer for --layers layers (the step's K/V come from memory, as in a served
step) and, as a second case, every table on the same blocks (cache-resident: the
arithmetic alone); rounds interleaved, medians, the load printed. Writes
paged_attention_amx.json.

    .venv/bin/python -m benchmarks.ops.paged_attention --amx --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

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


def amx_vs_vector(args: argparse.Namespace) -> None:
    """The decode kernel's two bfloat16 paths, ms a layer (see the module's docstring)."""
    from kernels import cpu_attention

    if cpu_attention.available() is not None or not cpu_attention.amx_available():
        raise SystemExit("needs the CPU attention kernels and AMX (amx_bf16)")
    gen = torch.Generator().manual_seed(args.seed)
    seqs, heads, dim, block = args.seqs, 4, 256, args.block_size
    ctx = torch.randint(args.min_context, args.max_context + 1, (seqs,), generator=gen)
    num_blocks = sum(-(-int(c) // block) for c in ctx)
    caches = [torch.randn(2, 1, num_blocks * block, dim, generator=gen).to(torch.bfloat16)
              for _ in range(args.layers)]  # fmt: skip
    width = max(-(-int(c) // block) for c in ctx)
    scattered = torch.zeros(seqs, width, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen)
    used = 0
    for i, c in enumerate(ctx.tolist()):
        n = -(-c // block)
        scattered[i, :n] = order[used : used + n].to(torch.int32)
        used += n
    resident = torch.arange(width, dtype=torch.int32).repeat(seqs, 1)
    q = torch.randn(seqs, heads, dim, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    starts = torch.arange(seqs, dtype=torch.int32)
    lens = torch.ones(seqs, dtype=torch.int32)
    ctx32 = ctx.to(torch.int32)

    def step(tables: torch.Tensor, amx: bool, layers: list[torch.Tensor]) -> float:
        begin = time.perf_counter()
        for cache in layers:
            torch.ops.vlmserve.paged_attention(
                out, q, cache, tables, starts, lens, ctx32, block, dim**-0.5, 0, amx
            )
        return (time.perf_counter() - begin) / len(layers)

    outs = {}
    for amx in (True, False):
        step(scattered, amx, caches[:1])
        outs[amx] = out.clone()
    torch.testing.assert_close(outs[True], outs[False], rtol=2e-2, atol=2e-2)
    cases = {"from memory": (scattered, caches), "cache-resident": (resident, caches[:1] * 8)}
    samples = {(case, amx): [] for case in cases for amx in (True, False)}
    load = os.getloadavg()
    for r in range(args.rounds):
        for case, (tables, layers) in cases.items():
            for amx in (True, False) if r % 2 == 0 else (False, True):
                samples[case, amx].append(step(tables, amx, layers))
    rows = []
    for case in cases:
        amx_ms = 1e3 * statistics.median(samples[case, True])
        vector_ms = 1e3 * statistics.median(samples[case, False])
        keys = int(ctx.sum())
        rows.append({"case": case, "vector_ms": vector_ms, "amx_ms": amx_ms,
                     "speedup": vector_ms / amx_ms,
                     "amx_kv_gb_per_s": keys * dim * 4 / (amx_ms / 1e3) / 1e9})  # fmt: skip
    print(f"load average before: {load}")
    print(table(rows, ["case", "vector_ms", "amx_ms", "speedup", "amx_kv_gb_per_s"]))
    result = {"args": vars(args), "load_average_before": load, "rows": rows,
              "samples_ms": {f"{c}/{'amx' if a else 'vector'}": [1e3 * x for x in v]
                             for (c, a), v in samples.items()}}  # fmt: skip
    print(f"wrote {write_result('paged_attention_amx', result)}")


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
    p.add_argument("--amx", action="store_true", help="the AMX path against the vector path")
    p.add_argument("--layers", type=int, default=18, help="--amx: caches (layers) a step")
    p.add_argument("--rounds", type=int, default=5, help="--amx: interleaved rounds")
    args = p.parse_args()
    if args.amx:
        return amx_vs_vector(args)
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

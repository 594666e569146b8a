"""Decode attention over the paged KV cache: the torch backend against gather + SDPA.

One layer of the offline-throughput model's decode step (12 query / 4 KV heads, head dim
64, 16-token blocks scattered over the cache): 64 sequences, one query token each, with
contexts drawn from 300-1200 tokens. The baseline is the straightforward plain-torch way,
the backend before it was rewritten: per context bucket, index the cache by slot (a fresh
tensor each call) and call SDPA with `enable_gqa` and a boolean mask. Outputs are checked
equal before timing; medians over --repeat calls.

    .venv/bin/python -m benchmarks.ops.paged_attention

--gemma: the decode kernel's bfloat16 paths at Gemma 3 270M's shape (4 query / 1 KV head
of dim 256): the vector path with either prefetch of the next block (by lines as it goes,
or whole at once: `decode_spread_wins` calibrates which) and, on a CPU with AMX, the AMX
path; 64 sequences of --min/--max-context keys on scattered 16-token blocks, one cache per
layer for --layers layers (the step's K/V come from memory, as in a served step) and, as
a second case, every table on the same blocks (cache-resident: the arithmetic alone);
beside them a sequential read of the same bytes (a float32 sum: the memory roofline).
Rounds interleaved, medians, the CPU and the load recorded. Writes
paged_attention_gemma.json (--name).

    .venv/bin/python -m benchmarks.ops.paged_attention --gemma --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.lib.common import machine, median_time, table, write_result
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


def gemma_decode(args: argparse.Namespace) -> None:
    """The decode kernel's bfloat16 paths at Gemma 3 270M's shape, ms a layer (see the
    module's docstring), against a sequential read of the same bytes."""
    from kernels import cpu_attention

    if cpu_attention.available() is not None:
        raise SystemExit(f"needs the CPU attention kernels: {cpu_attention.available()}")
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
    keys = int(ctx.sum())
    kv_bytes = keys * dim * 4  # K and V, bfloat16

    # (amx, spread): the vector path with either prefetch, the AMX path where it runs
    paths = {
        "vector, next block by lines": (False, True),
        "vector, next block whole": (False, False),
    }
    if cpu_attention.amx_available():
        paths["amx tiles"] = (True, True)

    def step(tables: torch.Tensor, path: tuple[bool, bool], layers: list[torch.Tensor]) -> float:
        begin = time.perf_counter()
        for cache in layers:
            torch.ops.vlmserve.paged_attention(
                out, q, cache, tables, starts, lens, ctx32, block, dim**-0.5, 0, *path
            )
        return (time.perf_counter() - begin) / len(layers)

    def stream(layers: list[torch.Tensor]) -> float:
        """A sequential read of each layer's K/V bytes (its used slots), the roofline."""
        begin = time.perf_counter()
        for cache in layers:
            cache[:, :, :keys].view(torch.float32).sum()
        return (time.perf_counter() - begin) / len(layers)

    outs = {}
    for name, path in paths.items():
        step(scattered, path, caches[:1])
        outs[name] = out.clone()
    for name in paths:
        torch.testing.assert_close(outs[name], outs[next(iter(paths))], rtol=2e-2, atol=2e-2)
    cases = {"from memory": (scattered, caches), "cache-resident": (resident, caches[:1] * 8)}
    read = "sequential read"  # from memory only: the roofline of that case
    runs = {"from memory": [*paths, read], "cache-resident": list(paths)}
    samples: dict[tuple[str, str], list[float]] = {
        (case, name): [] for case in cases for name in runs[case]
    }
    load = os.getloadavg()
    for r in range(args.rounds):
        for case, (tables, layers) in cases.items():
            names = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in names:
                samples[case, name].append(step(tables, paths[name], layers))
            if read in runs[case]:
                samples[case, read].append(stream(layers))
    rows = []
    for case in cases:
        for name in runs[case]:
            ms = 1e3 * statistics.median(samples[case, name])
            rows.append({"case": case, "path": name, "ms_a_layer": ms,
                         "kv_gb_per_s": kv_bytes / (ms / 1e3) / 1e9})  # fmt: skip
    roofline = next(r["ms_a_layer"] for r in rows if r["path"] == read)
    for row in rows:
        if row["case"] == "from memory":
            row["of_sequential_read"] = roofline / row["ms_a_layer"]
    print(f"load average before: {load}, after: {os.getloadavg()}")
    print(table(rows, ["case", "path", "ms_a_layer", "kv_gb_per_s", "of_sequential_read"]))
    samples_ms = {f"{c}/{n}": [1e3 * x for x in v] for (c, n), v in samples.items()}
    result = {"args": vars(args), "machine": machine(), "load_average_before": load,
              "load_average_after": os.getloadavg(), "rows": rows,
              "samples_ms": samples_ms}  # fmt: skip
    print(f"wrote {write_result(args.name, result)}")


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
    p.add_argument("--gemma", action="store_true", help="the kernel's paths at Gemma 3's shape")
    p.add_argument("--layers", type=int, default=18, help="--gemma: caches (layers) a step")
    p.add_argument("--rounds", type=int, default=5, help="--gemma: interleaved rounds")
    p.add_argument("--name", default=None, help="--gemma: the result file's name")
    args = p.parse_args()
    if args.gemma:
        args.name = args.name or "paged_attention_gemma"
        return gemma_decode(args)
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

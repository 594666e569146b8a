"""bfloat16 against float32 on this CPU: the decoder's GEMMs, then the whole engine.

Kernels: one decoder layer's linears of the offline-throughput model (fused qkv, o,
gate/up, down) at decode and prefill row counts, GFLOP/s of
- float32 `PackedLinear(plain=True)`, the engine's float32 path (skinny / oneDNN / MKL),
  and float32 oneDNN packed alone,
- bfloat16 `PackedLinear(plain=True)`, the engine's bfloat16 path (skinny / oneDNN),
- bfloat16 oneDNN packed alone and bfloat16 `F.linear` (torch's plain path) for the choice
  of thresholds in kernels/packed_linear.py.
Contenders alternate call by call; medians over --rounds.

Engine: the offline-throughput workload (--quick sizes by default) on one float32 random
checkpoint, run with `--dtype float32` and `--dtype bfloat16` in alternating rounds
(a fresh engine each), output tok/s medians and their ratio, and the share of requests
whose greedy outputs are identical between the two.

    .venv/bin/python -m benchmarks.engine.bf16_speedup               # short: kernels + quick engine
    .venv/bin/python -m benchmarks.engine.bf16_speedup --full        # the full offline workload
    .venv/bin/python -m benchmarks.engine.bf16_speedup --threads 1 --name bf16_speedup_1thread
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.engine.offline_throughput import parse_args as offline_args
from benchmarks.engine.offline_throughput import run_engine, workload
from benchmarks.lib.common import environment, table, write_result
from kernels.packed_linear import PackedLinear
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

ROWS = (1, 4, 16, 64, 512, 2048)


def layer_shapes(model: argparse.Namespace) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears, in the engine's fused layout."""
    head_dim = model.hidden // model.heads
    qkv = (model.heads + 2 * model.kv_heads) * head_dim
    return [(model.hidden, qkv), (model.hidden, model.hidden),
            (model.hidden, 2 * model.intermediate), (model.intermediate, model.hidden)]  # fmt: skip


def plain(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def contenders(model: argparse.Namespace) -> dict[str, tuple[torch.dtype, list]]:
    """name -> (input dtype, one callable per layer)."""
    torch.manual_seed(0)
    fp32 = [nn.Linear(k, n, bias=False) for k, n in layer_shapes(model)]
    bf16 = [nn.Linear(k, n, bias=False).to(torch.bfloat16) for k, n in layer_shapes(model)]
    packed_bf16 = [PackedLinear(layer) for layer in bf16]
    return {
        "fp32 engine path": (torch.float32, [PackedLinear(layer, plain=True) for layer in fp32]),
        "fp32 onednn packed": (torch.float32, [PackedLinear(layer) for layer in fp32]),
        "bf16 engine path": (torch.bfloat16, [PackedLinear(layer, plain=True) for layer in bf16]),
        "bf16 onednn packed": (torch.bfloat16, packed_bf16),
        "bf16 F.linear": (
            torch.bfloat16,
            [functools.partial(plain, layer.weight.detach()) for layer in bf16],
        ),
    }


def kernel_table(model: argparse.Namespace, rounds: int) -> list[dict]:
    layers = contenders(model)
    flops_per_row = 2 * sum(k * n for k, n in layer_shapes(model))
    rows_out = []
    for rows in ROWS:
        inputs = {dtype: {k: torch.randn(rows, k).to(dtype) for k, _ in layer_shapes(model)}
                  for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in layers}
        repeat = max(1, 64 // max(1, rows // 16))  # about equal work a sample at every size
        for round_ in range(rounds + 1):  # round 0 warms up (packing, first allocations)
            for name, (dtype, fns) in layers.items():
                xs = inputs[dtype]
                start = time.perf_counter()
                for _ in range(repeat):
                    for fn, (k, _) in zip(fns, layer_shapes(model), strict=True):
                        fn(xs[k])
                if round_:
                    times[name].append((time.perf_counter() - start) / repeat)
        row = {"rows": rows}
        for name, samples in times.items():
            row[name] = flops_per_row * rows / statistics.median(samples) / 1e9
        row["bf16/fp32"] = row["bf16 engine path"] / row["fp32 engine path"]
        rows_out.append(row)
        print(table([row], list(row)), flush=True)
    return rows_out


def engine_rounds(args: argparse.Namespace) -> dict:
    """The offline workload, float32 and bfloat16 engines alternating, a fresh one a run."""
    model = offline_args(["--skip-hf"] + ([] if args.full else ["--quick"]))
    model.num_requests = args.num_requests or model.num_requests
    requests = workload(model)
    useful = sum(out for _, out in requests)
    runs: dict[str, list[dict]] = {"float32": [], "bfloat16": []}
    with tempfile.TemporaryDirectory() as tmp:
        make_text_checkpoint(
            tmp, "llama", hidden=model.hidden, layers=model.layers, heads=model.heads,
            kv_heads=model.kv_heads, vocab=model.vocab, intermediate_size=model.intermediate,
        )  # fmt: skip
        for i in range(args.engine_rounds):
            order = ("float32", "bfloat16") if i % 2 == 0 else ("bfloat16", "float32")
            for dtype in order:
                model.dtype = dtype
                result = run_engine(tmp, requests, model)
                runs[dtype].append(result)
                print(f"round {i} {dtype}: {useful / result['seconds']:.1f} tok/s "
                      f"({result['seconds']:.1f} s)", flush=True)  # fmt: skip
    tok_s = {d: statistics.median(useful / r["seconds"] for r in rs) for d, rs in runs.items()}
    fp32_out, bf16_out = runs["float32"][0]["outputs"], runs["bfloat16"][0]["outputs"]
    same = sum(a.token_ids == b.token_ids for a, b in zip(fp32_out, bf16_out, strict=True))
    return {
        "num_requests": len(requests),
        "output_tokens": useful,
        "tok_per_s": tok_s,
        "seconds": {d: [r["seconds"] for r in rs] for d, rs in runs.items()},
        "speedup_bf16_over_fp32": tok_s["bfloat16"] / tok_s["float32"],
        "greedy_outputs_identical": f"{same}/{len(requests)}",
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="kernel rounds")
    p.add_argument("--engine-rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=0, help="0: the workload's")
    p.add_argument("--full", action="store_true", help="the full offline workload")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument(
        "--threads", type=int, default=0,
        help="torch threads (0: torch's default); 1 is steadier on a shared machine",
    )  # fmt: skip
    p.add_argument("--name", default="bf16_speedup", help="result file name")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model = offline_args([])
    kernels = kernel_table(model, args.rounds)
    engine = None if args.skip_engine else engine_rounds(args)
    result = {
        "command": " ".join(["python -m benchmarks.engine.bf16_speedup", *sys.argv[1:]]),
        "environment": environment(torch.device("cpu")),
        "load_average_before_after": [load_before, os.getloadavg()],
        "gemm_gflops": kernels,
        "engine": engine,
    }
    print(table(kernels, list(kernels[0])))
    if engine is not None:
        print({k: engine[k] for k in ("tok_per_s", "speedup_bf16_over_fp32",
                                      "greedy_outputs_identical")})  # fmt: skip
    print("load average before / after:", result["load_average_before_after"])
    write_result(args.name, result)
    return result


if __name__ == "__main__":
    main()

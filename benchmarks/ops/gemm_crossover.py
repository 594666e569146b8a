"""float32 prefill GEMMs: oneDNN's packed GEMM against MKL on the plain weight, by rows,
and what the engine's one-time calibration (kernels/calibration.py) picks on this CPU.

One pass = one decoder layer's linears of the offline-throughput model (fused qkv, o,
gate/up, down) at a row count; the two paths alternate pass by pass in the same run;
medians over --rounds passes, GFLOP/s. Then the calibration's own measurement (a square
1,024-wide GEMM at 2,048 and 1,024 rows) and its choice: MKL from that many rows, or never.

    .venv/bin/python -m benchmarks.ops.gemm_crossover            # 256-2,048 rows, 5 rounds
    .venv/bin/python -m benchmarks.ops.gemm_crossover --quick    # 1,024 and 2,048, 3 rounds
Writes benchmarks/results/gemm_crossover.json (the CPU's flags with it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.engine.offline_throughput import parse_args as offline_args
from benchmarks.lib.common import environment, table, write_result
from kernels import calibration, packed_linear


def layer_shapes(model: argparse.Namespace) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears."""
    head_dim = model.hidden // model.heads
    qkv = (model.heads + 2 * model.kv_heads) * head_dim
    return [(model.hidden, qkv), (model.hidden, model.hidden),
            (model.hidden, 2 * model.intermediate), (model.intermediate, model.hidden)]  # fmt: skip


def sweep(model: argparse.Namespace, rows_list: list[int], rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) / k**0.5 for k, n in layer_shapes(model)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    out = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w in weights}}

        def onednn(inputs: dict = inputs) -> None:
            for p, w in zip(packed, weights, strict=True):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")

        def mkl(inputs: dict = inputs) -> None:
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        times: dict[str, list[float]] = {"onednn": [], "mkl": []}
        for round_ in range(rounds + 1):  # round 0: primitives built, untimed
            for name, fn in (("onednn", onednn), ("mkl", mkl)):
                start = time.perf_counter()
                fn()
                if round_:
                    times[name].append(time.perf_counter() - start)
        onednn_s, mkl_s = (statistics.median(times[k]) for k in ("onednn", "mkl"))
        out.append({
            "rows": rows, "onednn_ms": onednn_s * 1e3, "mkl_ms": mkl_s * 1e3,
            "onednn_gflop_s": rows * flops_per_row / onednn_s / 1e9,
            "mkl_gflop_s": rows * flops_per_row / mkl_s / 1e9,
            "mkl_over_onednn": onednn_s / mkl_s,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="256,512,1024,1536,2048")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="1,024 and 2,048 rows, 3 rounds")
    p.add_argument("--name", default="gemm_crossover")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = "1024,2048", 3
    model = offline_args([])
    load_before = os.getloadavg()
    print(f"load average {load_before}, {torch.get_num_threads()} threads")
    rows = sweep(model, [int(r) for r in args.rows.split(",")], args.rounds)
    print(table(rows, ["rows", "onednn_ms", "mkl_ms", "onednn_gflop_s", "mkl_gflop_s",
                       "mkl_over_onednn"]))  # fmt: skip
    measured = packed_linear._measure_mkl()
    chosen = calibration.decide_mkl(measured)
    calibrated = {"measured": measured, "mkl_min_rows": chosen}
    print(f"calibration: {measured} -> MKL from {chosen} rows (None: never)")
    result = {
        "environment": environment(torch.device("cpu")), "threads": torch.get_num_threads(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "layer_shapes": layer_shapes(model), "rounds": args.rounds, "rows": rows,
        "calibration": calibrated,
    }  # fmt: skip
    print(f"wrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()

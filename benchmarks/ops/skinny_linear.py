"""The decoder's linear layers at decode and prefill batch sizes: oneDNN's packed GEMM
(the baseline, `PackedLinear` without plain weights) against `PackedLinear(plain=True)`,
which takes the skinny kernel up to the rows this CPU's calibration picked for each layer's
shape and MKL from the rows it picked (kernels/calibration.py; never, where oneDNN won).

One pass = every linear of the offline-throughput decoder in layer order (12 layers of
fused qkv, o, gate/up and down, then the LM head at decode sizes): 0.4 GB of weights, far
more than the caches, read from memory as in a real step. The two contenders alternate
pass by pass; medians over --rounds passes; the outputs are checked equal first. The achieved weight
bandwidth is set against a plain read of 0.4 GB (`torch.sum`).

    .venv/bin/python -m benchmarks.ops.skinny_linear
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from benchmarks.engine.offline_throughput import parse_args as offline_args
from benchmarks.lib.common import table, write_result
from kernels.packed_linear import PackedLinear, plain_rows, skinny_available


def decoder_linears(args: argparse.Namespace, plain: bool) -> list[PackedLinear]:
    """The decoder's linears, seeded alike for both contenders."""
    head_dim = args.hidden // args.heads
    qkv = (args.heads + 2 * args.kv_heads) * head_dim
    shapes = [(args.hidden, qkv), (args.hidden, args.hidden)]
    shapes += [(args.hidden, 2 * args.intermediate), (args.intermediate, args.hidden)]
    torch.manual_seed(0)
    layers = [nn.Linear(k, n, bias=False) for _ in range(args.layers) for k, n in shapes]
    layers.append(nn.Linear(args.hidden, args.vocab, bias=False))
    return [PackedLinear(layer, plain=plain) for layer in layers]


def pass_layers(layers: list[PackedLinear], rows: int) -> list[PackedLinear]:
    """The layers a pass at `rows` runs: the LM head only at decode sizes (a prefill
    chunk's head sees one row a sequence)."""
    return layers if rows < 256 else layers[:-1]


def one_pass(layers: list[PackedLinear], inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    rows = next(iter(inputs.values())).shape[0]
    return [layer(inputs[layer.in_features]) for layer in pass_layers(layers, rows)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,2,4,8,16,32,2048")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    why = skinny_available()
    if why is not None:
        raise SystemExit(f"the skinny kernel is unavailable here: {why}")
    model = offline_args([])
    baseline, plain = decoder_linears(model, False), decoder_linears(model, True)
    weight_bytes = sum(layer.plain.numel() * 4 for layer in plain)
    big = torch.ones(weight_bytes // 4)
    read_s = statistics.median(_timed(big.sum) for _ in range(5))
    read_gb_s = weight_bytes / read_s / 1e9
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads, "
          f"weights {weight_bytes / 1e9:.2f} GB, plain read {read_gb_s:.1f} GB/s")  # fmt: skip
    mkl_min_rows = plain_rows(torch.float32)[1]
    skinny_rows = sorted({layer.skinny_rows for layer in plain})  # calibrated per shape
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {k: torch.randn(rows, k) for k in (model.hidden, model.intermediate)}
        for a, b in zip(one_pass(baseline, inputs), one_pass(plain, inputs), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        rounds = max(2, args.rounds if rows < 256 else 3)
        times: dict[str, list[float]] = {"onednn_packed": [], "vlmserve": []}
        for _ in range(rounds):
            times["onednn_packed"].append(_timed(one_pass, baseline, inputs))
            times["vlmserve"].append(_timed(one_pass, plain, inputs))
        base, ours = (statistics.median(times[k]) for k in ("onednn_packed", "vlmserve"))
        params = sum(layer.plain.numel() for layer in pass_layers(plain, rows))
        path = "onednn"
        mkl = mkl_min_rows is not None and rows >= mkl_min_rows
        if rows <= skinny_rows[-1]:
            path = "skinny" if rows <= skinny_rows[0] else "skinny / onednn"
        path = "mkl" if mkl else path
        rows_out.append({
            "rows": rows, "path": path, "onednn_ms": base * 1e3, "vlmserve_ms": ours * 1e3,
            "speedup": base / ours, "onednn_gb_s": weight_bytes / base / 1e9,
            "vlmserve_gb_s": weight_bytes / ours / 1e9,
            "vlmserve_gflop_s": 2 * rows * params / ours / 1e9,
        })  # fmt: skip
    print(table(rows_out, ["rows", "path", "onednn_ms", "vlmserve_ms", "speedup",
                           "onednn_gb_s", "vlmserve_gb_s", "vlmserve_gflop_s"]))  # fmt: skip
    path = write_result("skinny_linear", {
        "loadavg": os.getloadavg(), "threads": torch.get_num_threads(),
        "weight_bytes": weight_bytes, "plain_read_gb_s": read_gb_s,
        "skinny_max_rows": skinny_rows, "mkl_min_rows": mkl_min_rows, "rows": rows_out,
    })  # fmt: skip
    print(f"wrote {path}")


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()

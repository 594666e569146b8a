"""Every CPU kernel-choice crossover on this CPU: the tables the engine's calibration
(kernels/calibration.py) measures and what it picks, at the real Gemma 3 270M's shapes.

Measured afresh here (the cache is neither read nor written), in each dtype asked for:
1. the decoder's linears (fused qkv, o, gate/up, down): the skinny kernel against oneDNN's
   packed GEMM at 1-64 rows -> the most rows the skinny kernel takes, per layer;
2. float32 only: MKL on the plain weight against oneDNN packed at 2,048 / 1,024 rows;
3. the LM head as calibrated (a 32 MiB slice of the [vocab, hidden] weight): the skinny
   kernel's float32 logits against oneDNN's packed GEMM and F.linear, widened, at 1-256
   rows -> the skinny kernel's rows and the GEMM above them; then the whole head
   ([rows, 640] x [262,144, 640]) at 64 rows through the three paths, to check the slice;
4. prefill attention (4 query / 1 KV heads of 256): the C++ kernel against SDPA on a
   fresh 1,024-token prompt and a 512-token chunk on a 512-token prefix.
Every table: seconds a call per path, interleaved rounds (`calibration.time_paths`), the
load average beside them.

    .venv/bin/python -m benchmarks.ops.calibration                    # bfloat16 and float32
    .venv/bin/python -m benchmarks.ops.calibration --dtype bfloat16 --skip-full-head
Writes benchmarks/results/calibration.json (the CPU's model and flags with it).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.lib.common import environment, table, write_result
from kernels import calibration, cpu_attention, packed_linear
from kernels.lm_head import HEAD_BUDGET_S, HEAD_LADDER, HEAD_MAX_BYTES

# Gemma 3 270M (google/gemma-3-270m): the real checkpoint's decoder.
GEMMA3_270M = {"hidden_size": 640, "num_heads": 4, "num_kv_heads": 1, "head_dim": 256,
               "intermediate_size": 2048, "vocab_size": 262144}  # fmt: skip


def layer_shapes(m: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(in, out) of one decoder layer's linears."""
    hidden, heads, kv, dim = m["hidden_size"], m["num_heads"], m["num_kv_heads"], m["head_dim"]
    return {"qkv": (hidden, (heads + 2 * kv) * dim), "o": (heads * dim, hidden),
            "gate_up": (hidden, 2 * m["intermediate_size"]),
            "down": (m["intermediate_size"], hidden)}  # fmt: skip


def ms(records: list[dict]) -> list[dict]:
    keep = ("rows", "cached", "tokens")
    return [{k: v if k in keep else round(v * 1e3, 4) for k, v in r.items()} for r in records]


def linears(dtype: torch.dtype, m: dict[str, int]) -> dict:
    out = {}
    for name, (k, n) in layer_shapes(m).items():
        n_m = packed_linear.measured_rows(n, k, dtype, packed_linear.LINEAR_MAX_BYTES)
        paths = ("skinny", "onednn")
        measured = packed_linear.measure_ladder(dtype, k, n_m, packed_linear.LINEAR_LADDER, paths)
        chosen = calibration.decide_max_rows(measured, "skinny", "onednn")
        print(f"\n{name} [{k} -> {n}] ({n_m} rows measured): skinny up to {chosen} rows (ms)")
        print(table(ms(measured), ["rows", "skinny", "onednn"]))
        out[name] = {"shape": [k, n], "measured": measured, "skinny_max_rows": chosen}
    return out


def lm_head(dtype: torch.dtype, m: dict[str, int], full: bool) -> dict:
    hidden, vocab = m["hidden_size"], m["vocab_size"]
    rows_m = packed_linear.measured_rows(vocab, hidden, dtype, HEAD_MAX_BYTES)
    paths = ("skinny", "packed", "plain")
    ladder, budget = HEAD_LADDER, HEAD_BUDGET_S
    measured = packed_linear.measure_ladder(dtype, hidden, rows_m, ladder, paths, budget)
    choice = calibration.decide_head(measured)
    print(f"\nLM head [{hidden} -> {vocab}] ({rows_m} rows measured): {choice} (ms)")
    print(table(ms(measured), ["rows", *paths]))
    result = {"measured_vocab_rows": rows_m, "measured": measured, "choice": choice._asdict()}
    if full:  # the whole head at 64 rows: does the slice rank the paths as the head does?
        gen = torch.Generator().manual_seed(1)
        weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        x = torch.randn(64, hidden, generator=gen).to(dtype)
        whole = calibration.time_paths({
            "skinny": lambda: packed_linear.skinny_linear(x, weight, None, torch.float32),
            "packed": lambda: packed_linear._onednn(x, packed).float(),
            "plain": lambda: torch.nn.functional.linear(x, weight).float(),
        })  # fmt: skip
        print(f"whole head at 64 rows (ms): { {k: round(v * 1e3, 2) for k, v in whole.items()} }")
        result["whole_head_64_rows"] = whole
        del weight, packed
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16,float32")
    p.add_argument("--skip-full-head", action="store_true", help="no whole 262k-vocab head")
    p.add_argument("--name", default="calibration")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    print(f"load average {load_before}, {torch.get_num_threads()} threads")
    print(f"machine key: {calibration.machine_key()['cpu']}")
    why = packed_linear.skinny_available() or cpu_attention.prefill_available()
    if why is not None:
        raise SystemExit(f"the CPU kernels are not available here: {why}")
    m = GEMMA3_270M
    per_dtype = {}
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        print(f"\n== {name} ==")
        start = time.perf_counter()
        result: dict = {"linears": linears(dtype, m)}
        if dtype == torch.float32:
            measured = packed_linear._measure_mkl()
            result["mkl"] = {"measured": measured, "mkl_min_rows": calibration.decide_mkl(measured)}
            print(f"\nfloat32 MKL: {ms(measured)} -> from {result['mkl']['mkl_min_rows']} rows")
        result["lm_head"] = lm_head(dtype, m, full=not args.skip_full_head)
        heads, kv, dim = m["num_heads"], m["num_kv_heads"], m["head_dim"]
        measured = cpu_attention._measure_prefill(dtype, heads, kv, dim)
        wins = calibration.decide_faster(measured, "kernel", "sdpa")
        print(f"\nprefill attention {heads}q/{kv}kv x {dim}: {'kernel' if wins else 'SDPA'} (ms)")
        print(table(ms(measured), ["cached", "tokens", "kernel", "sdpa"]))
        result["prefill_attention"] = {"measured": measured, "kernel": wins}
        result["seconds"] = round(time.perf_counter() - start, 2)
        per_dtype[name] = result
    out = {
        "environment": environment(torch.device("cpu")), "key": calibration.machine_key(),
        "threads": torch.get_num_threads(), "model": m,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "dtypes": per_dtype,
    }  # fmt: skip
    print(f"\nwrote {write_result(args.name, out)}")
    return out


if __name__ == "__main__":
    main()

"""The real checkpoint's linears run from their stored GGUF blocks (kernels/quant_linear.py)
against the engine's bfloat16 path on the same weights dequantized (`PackedLinear` with
its plain weight: the skinny kernel or oneDNN, as calibrated here; the LM head through
`logits_head`: skinny or oneDNN as calibrated, float32 logits).

The shapes are Gemma 3 270M's (the Q4_K_M file, fetched by benchmarks.lib.real_model):
one pass = a layer kind over all 18 layers (each its own weight, as a decode step reads
them), split by the block types the file gives that kind (down: Q6_K in some layers,
Q4_K in others), and the 262,144 x 640 Q8_0 LM head (tied to the embedding). bfloat16 x
at 1, 4, 16, 64, 256 rows; the two contenders alternate pass by pass; medians of
--rounds; ratio = bfloat16 ms / quantized ms (> 1: the quantized path is faster). The
outputs are checked against each other first (the int8 activations' bound). The
`decode_step_linears` rows sum the kinds: every linear of one decode step.

    .venv/bin/python -m benchmarks.ops.quant_linear   # -> benchmarks/results/quant_linear.json

The crossovers are calibrated at first use (kernels/calibration.py; VLMSERVE_RECALIBRATE=1
measures them anew, e.g. after a run on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from collections import defaultdict

import torch
from torch import nn

from benchmarks.lib.common import table, write_result
from benchmarks.lib.real_model import fetch_gguf
from kernels.lm_head import logits_head
from kernels.packed_linear import PackedLinear
from kernels.quant_linear import QuantLinear, QuantWeight, best_isa, kernel_available

ISA_NAMES = {0: "scalar", 1: "avx2 maddubs", 2: "avx-vnni dpbusd", 3: "avx512-vnni dpbusd"}
# kind -> the GGUF tensors stacked along out (the engine fuses q|k|v and gate|up)
KINDS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
         "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}  # fmt: skip


def load_groups() -> dict[str, list[list[QuantWeight]]]:
    """'kind types' (e.g. "down Q6_K") -> per layer, its parts."""
    from vlmserve.worker.models.gguf_file import GGUFFile

    gguf_file = GGUFFile(fetch_gguf())
    by_name = {t.name: t for t in gguf_file.tensors}
    layers = sorted({int(m.group(1)) for n in by_name if (m := re.match(r"blk\.(\d+)\.", n))})
    groups: dict[str, list[list[QuantWeight]]] = defaultdict(list)
    for layer in layers:
        for kind, names in KINDS.items():
            infos = [by_name[f"blk.{layer}.{n}.weight"] for n in names]
            parts = [QuantWeight.from_gguf(gguf_file.raw(i), i.qtype, i.shape) for i in infos]
            types = "+".join(sorted({_type(p.qtype) for p in parts}, key=str))
            groups[f"{kind} {types}"].append(parts)
    emb = by_name["token_embd.weight"]
    groups[f"lm_head {_type(emb.qtype)}"].append(
        [QuantWeight.from_gguf(gguf_file.raw(emb), emb.qtype, emb.shape)]
    )
    return groups


def _type(qtype: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


def contenders(group: str, layers: list[list[QuantWeight]]):
    """(quantized modules, bfloat16 modules, run function) for one group."""
    quant = [QuantLinear(parts) for parts in layers]
    for layer in quant:  # as the engine places them (models/quantized.py's `place`)
        for part in layer.parts:
            part.pack()
    dense = [torch.cat([p.dequantize(dtype=torch.bfloat16) for p in parts]) for parts in layers]
    if group.startswith("lm_head"):
        heads = [logits_head(None, w) for w in dense]
        return quant, heads, lambda q, x: q.forward_float(x)
    bf16 = []
    for w in dense:
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(w, requires_grad=False)
        bf16.append(PackedLinear(linear, plain=True))
    return quant, bf16, lambda q, x: q(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--name", default="quant_linear", help="the result file's name")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if (why := kernel_available()) is not None:
        raise SystemExit(f"the quantized kernels are unavailable here: {why}")
    groups = load_groups()
    row_counts = [int(r) for r in args.rows.split(",")]
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads, "
          f"int-dot on {ISA_NAMES[best_isa()]}")  # fmt: skip
    results, totals = [], defaultdict(lambda: {"bf16": 0.0, "quant": 0.0})
    for group, layers in groups.items():
        quant, bf16, run_quant = contenders(group, layers)
        in_features = layers[0][0].in_features
        describe = quant[0].describe()  # calibrates (first use on this CPU)
        quant_bytes = sum(p.blocks.numel() for parts in layers for p in parts)
        for rows in row_counts:
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
            x = x.to(torch.bfloat16)
            outs = [
                (run_quant(q, x).float(), b(x).float()) for q, b in zip(quant, bf16, strict=True)
            ]
            for ours, theirs in outs:
                err = float((ours - theirs).norm() / theirs.norm())
                assert err < 3e-2, f"{group} at {rows} rows: relative difference {err:.3g}"
            times: dict[str, list[float]] = {"bf16": [], "quant": []}
            rounds = args.rounds if rows < 256 or not group.startswith("lm") else 3
            passes = {
                "bf16": lambda x=x, mods=bf16: [b(x) for b in mods],
                "quant": lambda x=x, mods=quant, run=run_quant: [run(q, x) for q in mods],
            }
            for _ in range(rounds):
                for name, one_pass in passes.items():
                    times[name].append(_timed(one_pass))
            base, ours = (statistics.median(times[k]) for k in ("bf16", "quant"))
            totals[rows]["bf16"] += base
            totals[rows]["quant"] += ours
            results.append({
                "group": group, "layers": len(layers), "rows": rows, "bf16_ms": base * 1e3,
                "quant_ms": ours * 1e3, "ratio": base / ours,
                "quant_gb_s": quant_bytes / ours / 1e9, "path": describe,
            })  # fmt: skip
            print(table(results[-1:], ["group", "rows", "bf16_ms", "quant_ms", "ratio"]))
    for rows, t in sorted(totals.items()):
        results.append({"group": "decode_step_linears", "rows": rows, "bf16_ms": t["bf16"] * 1e3,
                        "quant_ms": t["quant"] * 1e3, "ratio": t["bf16"] / t["quant"]})  # fmt: skip
    columns = ["group", "layers", "rows", "bf16_ms", "quant_ms", "ratio", "quant_gb_s"]
    print(table(results, columns))
    path = write_result(args.name, {
        "loadavg": os.getloadavg(), "threads": torch.get_num_threads(),
        "int_dot_isa": ISA_NAMES[best_isa()], "rounds": args.rounds, "results": results,
    })  # fmt: skip
    print(f"wrote {path}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()

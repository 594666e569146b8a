"""Where a bfloat16 step's time goes, and the LM head's two paths.

1. decode: torch.profiler over decode-phase steps of the offline-throughput workload (the
   100M Llama) in bfloat16: self-CPU share per op, and the share of each region of the
   step (embedding gather, decoder layers, LM head, everything else: sampling, the
   scheduler, host work), labelled on the live engine;
2. image prefill: the same over the prefill of one 1024 x 768 image request on the
   vs_vllm image workload's LLaVA-OneVision random checkpoint (SigLIP tower: patch conv,
   LayerNorm, SDPA, the packed GEMMs; then the decoder);
3. the LM head alone ([rows, hidden] x [vocab, hidden] in bfloat16, float32 logits out)
   at 1-512 rows: the skinny kernel's float32 output against oneDNN's packed bfloat16
   GEMM widened to float32, alternating, medians.

    .venv/bin/python -m benchmarks.ops.bf16_profile            # full
    .venv/bin/python -m benchmarks.ops.bf16_profile --quick    # short
Writes benchmarks/results/bf16_profile.json (the CPU's flags with it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine.offline_throughput import make_engine, workload
from benchmarks.lib.common import environment, table, write_result
from benchmarks.lib.vs_vllm_workloads import text_args, write_image_workload
from benchmarks.ops.real_profile import labelled
from kernels.packed_linear import PackedLinear, skinny_available, skinny_linear
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

REGIONS = ("embed", "decoder_layers", "lm_head", "vision_tower")


def label_regions(engine: Engine) -> None:
    """Wrap the model's regions in record_function labels (instance attributes over the
    bound methods: the runner calls them as usual)."""
    decoder, vision = engine.runner.model.decoder, engine.runner.model.vision
    decoder.embed = labelled(decoder.embed, "embed")
    decoder.forward = labelled(decoder.forward, "decoder_layers")
    decoder.compute_logits = labelled(decoder.compute_logits, "lm_head")
    decoder.compute_argmax = labelled(decoder.compute_argmax, "lm_head")  # greedy: + argmax
    if vision is not None:
        vision.tile_features = labelled(vision.tile_features, "vision_tower")


def profiled(engine: Engine, steps: Callable[[], int], top: int) -> dict:
    """Run `steps` (returns how many engine steps it ran) under the profiler: the top ops
    by self-CPU share, each region's share of the wall time, ms per step."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        num_steps = steps()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events if e.key not in REGIONS)
    ranked = sorted(
        (e for e in events if e.key not in REGIONS), key=lambda e: -e.self_cpu_time_total
    )[:top]
    ops = [{"op": e.key, "self_share": round(e.self_cpu_time_total / total, 3),
            "calls": e.count} for e in ranked]  # fmt: skip
    # regions: their CPU time (inclusive) on the engine thread, as a share of the wall
    regions = {e.key: e.cpu_time_total / 1e6 for e in events if e.key in REGIONS}
    shares = {k: round(v / wall, 3) for k, v in regions.items()}
    shares["other"] = round(1 - sum(shares.values()), 3)  # sampling, scheduler, host work
    return {"ms_per_step": wall / max(1, num_steps) * 1e3, "steps": num_steps,
            "region_share": shares, "ops": ops}  # fmt: skip


def decode_profile(args: argparse.Namespace, model: argparse.Namespace, tmp: Path) -> dict:
    requests = workload(model)
    path = tmp / "text"
    make_text_checkpoint(
        path, "llama", hidden=model.hidden, layers=model.layers, heads=model.heads,
        kv_heads=model.kv_heads, vocab=model.vocab, intermediate_size=model.intermediate,
    )  # fmt: skip
    engine = make_engine(str(path), requests, model)
    for ids, out in requests:
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        engine.add_request(Request(prompt_token_ids=ids, sampling=params))
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(3):  # the decode batch's shapes met once
        engine.step()
    label_regions(engine)
    running = len(sched.running)

    def steps() -> int:
        for _ in range(args.steps):
            engine.step()
        return args.steps

    return {"running": running, **profiled(engine, steps, args.top)}


def image_profile(args: argparse.Namespace, model: argparse.Namespace, tmp: Path) -> dict:
    spec = write_image_workload(tmp / "image", model, 2, 4, args.vision_layers)
    sizing = [(range(4096), 4), (range(4096), 4)]
    engine = make_engine(spec["model"], sizing, model)

    def request(item: dict) -> Request:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        return Request(prompt=item["prompt"], images=[item["image"]], sampling=params)

    engine.generate([request(spec["requests"][0])])  # every shape met once
    label_regions(engine)
    engine.add_request(request(spec["requests"][1]))

    def steps() -> int:
        n = 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        return n

    return profiled(engine, steps, args.top)


def lm_head_sweep(args: argparse.Namespace, model: argparse.Namespace) -> list[dict]:
    """The bf16 LM head at each row count: skinny (float32 out) vs oneDNN bf16 + widen."""
    if skinny_available() is not None:
        return []
    torch.manual_seed(0)
    head = PackedLinear(nn.Linear(model.hidden, model.vocab, bias=False).to(torch.bfloat16), True)
    rows_out = []
    for rows in args.head_rows:
        x = torch.randn(rows, model.hidden).to(torch.bfloat16)
        paths = {
            "skinny_f32_out": lambda x=x: skinny_linear(x, head.plain, None, torch.float32),
            "onednn_bf16_widened": lambda x=x: head(x).float(),
        }
        times: dict[str, list[float]] = {k: [] for k in paths}
        for round_ in range(args.rounds + 1):
            for name, fn in paths.items():
                start = time.perf_counter()
                fn()
                if round_:
                    times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        flops = 2 * rows * model.hidden * model.vocab
        rows_out.append({
            "rows": rows, "skinny_ms": med["skinny_f32_out"] * 1e3,
            "onednn_ms": med["onednn_bf16_widened"] * 1e3,
            "skinny_gflop_s": flops / med["skinny_f32_out"] / 1e9,
            "onednn_gflop_s": flops / med["onednn_bf16_widened"] / 1e9,
            "skinny_speedup": med["onednn_bf16_widened"] / med["skinny_f32_out"],
        })  # fmt: skip
    return rows_out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 requests, 8 steps, 3 rounds")
    p.add_argument("--steps", type=int, default=20, help="profiled decode steps")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--vision-layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=7, help="LM-head rounds a row count")
    p.add_argument("--head-rows", default="1,4,8,16,32,64,128,256,512")
    p.add_argument("--skip", default="", help="comma list of decode,image,head to skip")
    p.add_argument("--name", default="bf16_profile")
    args = p.parse_args(argv)
    args.head_rows = [int(r) for r in args.head_rows.split(",")]
    model = text_args(args.quick)
    model.dtype, model.device = "bfloat16", "cpu"
    if args.quick:
        args.steps, args.rounds = 8, 3
    skip = set(args.skip.split(","))
    result: dict = {"environment": environment(torch.device("cpu")), "dtype": "bfloat16"}
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("decode", decode_profile), ("image_prefill", image_profile)):
            if name.split("_")[0] in skip:
                continue
            result[name] = part = run(args, model, Path(tmp))
            print(f"\n{name}: {part['ms_per_step']:.1f} ms/step over {part['steps']} steps; "
                  f"regions (share of wall): {part['region_share']}")  # fmt: skip
            print(table(part["ops"], ["op", "self_share", "calls"]))
    if "head" not in skip:
        result["lm_head"] = lm_head_sweep(args, model)
        print(f"\nLM head [rows, {model.hidden}] x [{model.vocab}, {model.hidden}], bf16:")
        print(table(result["lm_head"], ["rows", "skinny_ms", "onednn_ms", "skinny_gflop_s",
                                        "onednn_gflop_s", "skinny_speedup"]))  # fmt: skip
    result["load_average_after"] = os.getloadavg()
    print(f"\nwrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()

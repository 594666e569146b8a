"""Nano-batched decode (NanoFlow §4.2) against the same engine sequential, in one run.

A random 12-layer Llama (hidden 512, GQA 8/4, head 64, intermediate 1536, vocab 8k) and
B requests decoding together at a constant dense batch of B rows (NanoFlow's setting):
prompts of --prompt tokens, --output greedy tokens each (ignore_eos). One engine runs the
whole workload; once every prompt is in, its decode steps alternate between the
nano-batched layers and the plain ones step by step (the finest interleaving: both modes
see the same load, contexts and batch), and the table gives medians per mode of

    forward ms   the step's forward + sampling, wall
    cpu ms       the process's CPU time over the step (all threads)
    tok/s        B / forward

the ratio plain / nano, and the fraction of NanoFlow's optimal throughput,
Compute / (2 P) (search/costmodel/cost_model.py `optimal_throughput`, Compute the matmul peak
measured now on all threads, P the decoder's parameters without embeddings).

The schedule is NanoFlow's 8B pipeline (search/nanoflow/handmade_schedules.py, two nano-batches,
the attention of one beside the GEMMs of the other; `--schedule four-two` for the 70B
shape), timed by a roofline of this CPU measured now: on one core for the nano-operations
(each worker thread has one), on all cores for the sequential layer. Its verdict (does
the makespan beat the sequential time) is reported next to the measured ratio; the run
splits either way. Every --check-every-th timed step is run again in the other mode and
the greedy tokens compared.

    .venv/bin/python -m benchmarks.engine.nanobatch            # ~2 minutes
    .venv/bin/python -m benchmarks.engine.nanobatch --quick    # smoke-sized
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib.common import environment, matmul_peak, memory_bandwidth, table, write_result
from scheduler.config import CacheConfig, SchedulerConfig
from search.costmodel.cost_model import optimal_throughput
from search.nanoflow.handmade_schedules import DurationUs, four_two_schedule, two_way_schedule
from search.nanoflow.schedule import Schedule
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

# plain: the engine's default (torch on every core); plain_1t: the plain path on one
# intra-op thread (as each nano stream has), which separates what overlap gives from what
# OpenMP's barriers cost on cores shared with other processes.
MODES = ("plain", "plain_1t", "nano")


def roofline_us(
    args: argparse.Namespace, context: int, peak: float, bandwidth: float, elem: int = 4
):
    """(op, rows) -> microseconds on a device of `peak` FLOP/s and `bandwidth` B/s:
    max(FLOPs / peak, bytes / bandwidth) per op, `elem` bytes an element, decode
    attention reading each row's `context` tokens of K and V."""
    h, i, d = args.hidden, args.intermediate, args.hidden // args.heads
    kv = args.kv_heads * d
    gemms = {"qkv": (h, h + 2 * kv), "o_proj": (h, h), "gate_up": (h, 2 * i), "down": (i, h)}
    streamed = {"input_norm": 2 * h, "rope_kv_write": h + 2 * kv, "post_norm": 3 * h,
                "silu_mul": 3 * i}  # fmt: skip

    def duration(op: str, rows: int) -> float:
        if op in gemms:
            k, n = gemms[op]
            flops, num_bytes = 2 * rows * k * n, elem * (k * n + rows * (k + n))
        elif op == "attention":
            flops, num_bytes = 4 * rows * context * args.heads * d, elem * rows * context * 2 * kv
        else:
            flops, num_bytes = 0, elem * rows * streamed[op]
        return 1e6 * max(flops / peak, num_bytes / bandwidth)

    return duration


def make_schedule(args: argparse.Namespace, one_core: DurationUs, all_cores: DurationUs):
    build = two_way_schedule if args.schedule == "two-way" else four_two_schedule
    split = build("bench", "cpu", args.batch, one_core)
    sequential = build("bench", "cpu", args.batch, all_cores)
    # The unsplit layer runs on every core; the split one's nano-operations on one each.
    unsplit = sum(all_cores(n.op, args.batch) for n in sequential.nano_ops if n.row_start == 0)
    return Schedule(split.model, split.device, split.dense_batch, split.nano_ops, unsplit,
                    {"source": f"benchmarks.engine.nanobatch {args.schedule}, "
                               "CPU roofline"})  # fmt: skip


def run(path: str, schedule_path: Path, args: argparse.Namespace) -> dict:
    """One engine over the workload; decode-only steps alternate modes."""
    # every request's blocks, plus the admission watermark (1%) and a margin: all admitted
    blocks = int(args.batch * (-(-(args.prompt + args.output) // 16)) * 1.02) + 64
    engine = Engine(
        EngineConfig(
            ModelConfig(
                path, device=args.device, dtype=args.dtype, nano_batch=str(schedule_path)
            ),  # fmt: skip
            CacheConfig(num_blocks=blocks, block_size=16),
            SchedulerConfig(max_num_batched_tokens=args.token_budget, max_num_seqs=args.batch),
        )
    )
    runner = engine.runner
    batcher = runner.nano_batcher
    batcher.always = True  # measure the split whatever the schedule's verdict
    gen = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    for _ in range(args.batch):
        ids = torch.randint(10, args.vocab, (args.prompt,), generator=gen).tolist()
        engine.add_request(Request(prompt_token_ids=ids, sampling=params))
    modes = MODES if args.device == "cpu" else ("plain", "nano")
    rows = {mode: [] for mode in modes}
    agree = checked = 0
    prepare, run_forward = runner.prepare, runner.run
    last: dict = {}

    def spy_prepare(plan, *a):  # the step's inputs, to rerun them in the other mode
        inputs = prepare(plan, *a)
        last["inputs"], last["plan"] = inputs, plan
        return inputs

    runner.prepare = spy_prepare
    threads = torch.get_num_threads()
    step = 0
    while engine.has_unfinished():
        running = engine.scheduler.running
        all_decode = len(running) == args.batch and all(
            s.num_uncomputed_tokens == 1 for s in running
        )
        mode = modes[step % len(modes)] if all_decode else "plain"
        runner.nano_batcher = batcher if mode == "nano" else None
        torch.set_num_threads(1 if mode == "plain_1t" else threads)
        forward, cpu = engine.times.forward_s, time.process_time()
        engine.step()
        torch.set_num_threads(threads)
        if not all_decode:
            continue
        rows[mode].append(
            {"forward_ms": 1e3 * (engine.times.forward_s - forward),
             "cpu_ms": 1e3 * (time.process_time() - cpu)}
        )  # fmt: skip
        if step % args.check_every == 0:
            agree += _same_tokens(runner, last["plan"], batcher, run_forward)
            checked += 1
        step += 1
    runner.nano_batcher = batcher
    return {"rows": rows, "greedy_agree": agree, "greedy_checked": checked,
            "nano_steps": runner.num_nano_steps}  # fmt: skip


def _same_tokens(runner, plan, batcher, run_forward) -> bool:
    """The step's inputs again in both modes (its KV writes are the same values again):
    the same greedy token on every row."""
    with torch.inference_mode():
        out = []
        for nano in (None, batcher):
            runner.nano_batcher = nano
            out.append(run_forward(runner.prepare(plan)).argmax(-1))
    return bool(torch.equal(out[0], out[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype", default="auto", help="auto: the engine's rule (vlmserve.config.choose_dtype)"
    )
    p.add_argument("--batch", type=int, default=64, help="dense batch: decoding requests")
    p.add_argument("--prompt", type=int, default=192)
    p.add_argument("--output", type=int, default=41)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--schedule", choices=["two-way", "four-two"], default="two-way")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--check-every", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 layers, batch 16, 9 tokens")
    p.add_argument("--name", default="nanobatch")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.batch, args.prompt, args.output = 4, 16, 32, 9
    return args


def decoder_params(args: argparse.Namespace) -> float:
    h, d = args.hidden, args.hidden // args.heads
    per_layer = h * (h + 2 * args.kv_heads * d) + h * h + 3 * h * args.intermediate
    return args.layers * per_layer + h * args.vocab  # + the LM head


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else None
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    peak, bw = matmul_peak(device, dtype, 1024), memory_bandwidth(device, 128 << 20)
    peak_1, bw_1 = peak, bw  # a GPU's nano-operations share the whole device
    if device.type == "cpu":  # each nano stream has one core
        torch.set_num_threads(1)
        peak_1, bw_1 = matmul_peak(device, dtype, 1024), memory_bandwidth(device, 128 << 20)
        torch.set_num_threads(threads)
    context = args.prompt + args.output // 2  # the decode steps' mean
    elem = dtype.itemsize
    schedule = make_schedule(
        args,
        roofline_us(args, context, peak_1, bw_1, elem),
        roofline_us(args, context, peak, bw, elem),
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = make_text_checkpoint(
            Path(tmp) / "model", "llama", hidden=args.hidden, layers=args.layers,
            heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab,
            intermediate_size=args.intermediate,
        )  # fmt: skip
        schedule_path = Path(tmp) / "schedule.json"
        schedule.save(schedule_path)
        result = run(str(path), schedule_path, args)
    load_after = os.getloadavg()
    if not all(result["rows"].values()):
        raise SystemExit(
            f"no step decoded all {args.batch} requests in every mode "
            f"({ {m: len(r) for m, r in result['rows'].items()} }): raise --output or "
            "--token-budget (the first requests finish before the last is admitted)"
        )
    medians = {
        mode: {k: statistics.median(r[k] for r in rows) for k in ("forward_ms", "cpu_ms")}
        for mode, rows in result["rows"].items()
    }
    optimal = optimal_throughput(peak, decoder_params(args))
    table_rows = []
    for mode in medians:
        m = medians[mode]
        m["tok_per_s"] = args.batch / (m["forward_ms"] / 1e3)
        m["fraction_of_optimal"] = m["tok_per_s"] / optimal
        m["steps"] = len(result["rows"][mode])
        table_rows.append({"mode": mode, **m})
    ratio = medians["plain"]["forward_ms"] / medians["nano"]["forward_ms"]
    ratio_1t = (
        medians.get("plain_1t", medians["plain"])["forward_ms"] / medians["nano"]["forward_ms"]
    )
    predicted = schedule.sequential_us / schedule.makespan_us
    print(table(table_rows, ["mode", "steps", "forward_ms", "cpu_ms", "tok_per_s",
                             "fraction_of_optimal"]))  # fmt: skip
    print(f"nano / plain throughput: {ratio:.3f}x (median forward per decode step)")
    print(f"nano / plain on one thread: {ratio_1t:.3f}x")
    print(f"schedule's own verdict: makespan {schedule.makespan_us:.0f} us vs sequential "
          f"{schedule.sequential_us:.0f} us per layer -> {predicted:.2f}x predicted")  # fmt: skip
    print(f"greedy tokens equal in {result['greedy_agree']}/{result['greedy_checked']} rechecks")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (2 cores)")
    out = {
        "workload": {k: getattr(args, k) for k in ("batch", "prompt", "output", "token_budget",
                     "schedule", "seed")},
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads",
                  "intermediate", "vocab")} | {"params_no_embed": decoder_params(args)},
        "environment": environment(device),
        "measured": {"matmul_peak_flops_1_thread": peak_1, "matmul_peak_flops": peak,
                     "copy_bandwidth_1_thread": bw_1, "copy_bandwidth": bw},
        "optimal_tok_per_s": optimal,
        "median": medians,
        "nano_over_plain": ratio,
        "nano_over_plain_1_thread": ratio_1t,
        "pays_here": ratio > 1.0,
        "schedule": {"nano_ops": len(schedule.nano_ops), "makespan_us": schedule.makespan_us,
                     "sequential_us": schedule.sequential_us, "predicted_speedup": predicted,
                     "pays_by_schedule": schedule.makespan_us < schedule.sequential_us},
        "greedy_agree": f"{result['greedy_agree']}/{result['greedy_checked']}",
        "load_average_before": load_before,
        "load_average_after": load_after,
        "note": "machine shared with other jobs while measured: modes alternate per decode "
                "step so both see the same load; compare the ratio, not absolute times",
        "steps": result["rows"],
    }  # fmt: skip
    print(f"wrote {write_result(args.name, out)}")
    return out


if __name__ == "__main__":
    main()

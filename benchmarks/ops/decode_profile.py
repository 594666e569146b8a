"""Where a decode step's time goes: torch.profiler over decode-phase steps of the
offline-throughput workload (same model, requests and engine settings; every prompt
fully prefilled before the profiled steps). Prints self-CPU share per op and writes the
table to benchmarks/results/<name>.json.

    .venv/bin/python -m benchmarks.ops.decode_profile                # full workload, 30 steps
    .venv/bin/python -m benchmarks.ops.decode_profile --quick --steps 10
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine.offline_throughput import make_engine, parse_args, workload
from benchmarks.lib.common import environment, table, write_result
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint


def profile_decode(engine: Engine, steps: int, top: int = 14) -> tuple[list[dict], float]:
    """Self-CPU share of the `top` ops over `steps` engine steps; and seconds per step."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    per_step = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    rows = [{"op": e.key, "self_share": round(e.self_cpu_time_total / total, 3),
             "calls": e.count} for e in ranked]  # fmt: skip
    return rows, per_step


def main(argv: list[str]) -> dict:
    steps = 30
    if "--steps" in argv:
        at = argv.index("--steps")
        steps, argv = int(argv[at + 1]), argv[:at] + argv[at + 2 :]
    args = parse_args(argv + ["--name", "decode_profile"])
    requests = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        make_text_checkpoint(
            tmp, "llama", hidden=args.hidden, layers=args.layers, heads=args.heads,
            kv_heads=args.kv_heads, vocab=args.vocab, intermediate_size=args.intermediate,
        )  # fmt: skip
        engine = make_engine(tmp, requests, args)
        for ids, out in requests:
            params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
            engine.add_request(Request(prompt_token_ids=ids, sampling=params))
        sched = engine.scheduler
        while sched.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in sched.running
        ):
            engine.step()
        rows, per_step = profile_decode(engine, steps)
        running = len(sched.running)
    print(table(rows, ["op", "self_share", "calls"]))
    print(f"{steps} decode steps, {per_step * 1e3:.0f} ms/step, {running} sequences running, "
          f"load average {os.getloadavg()}")  # fmt: skip
    result = {"environment": environment(torch.device(args.device)), "steps": steps,
              "ms_per_step": per_step * 1e3, "running": running,
              "load_average": os.getloadavg(), "ops": rows}  # fmt: skip
    write_result(args.name, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

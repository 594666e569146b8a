"""Async scheduling: one offline workload stepped in turn (sync) and with the next step
planned while the forward pass runs on its own thread (async), in interleaved rounds.

A small random Llama (4 layers, hidden 256, GQA 4/2, vocab 8k) and B requests decoding
together (B = 64 and 256): random prompts of 16-48 tokens, 64 output tokens each
(greedy, ignore_eos). Per step it reports the engine thread's CPU time outside the
forward (planning, input building, stop checks, detokenising, bookkeeping: the
scheduler's time, `Engine.times.host_s`), the forward's wall time, the step's wall time,
and how much of the host time the overlap hides:

    exposed = the gap between the end of one forward and the start of the next
              (a GPU's idle time; sync: all of the host's time)
    hidden  = 1 - exposed / host            (async; sync hides nothing)

Torch runs on --threads threads (default 1), so on a 2-core machine the forward has one
core and the engine thread the other, as a host and its GPU would. Each (batch, mode) runs
--rounds times, the mode order alternating per round; the table shows medians. Outputs
must be identical between the modes (greedy); the run stops if they are not.

    .venv/bin/python -m benchmarks.engine.async_scheduling            # ~2-3 minutes
    .venv/bin/python -m benchmarks.engine.async_scheduling --quick    # batch 16, one round
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.lib.common import environment, table, write_result
from scheduler.config import CacheConfig, SchedulerConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

MODES = ("sync", "async")
# An async engine lowers the interpreter's switch interval (vlmserve.engine.forward_thread): the
# sync runs get CPython's default back, as a user with async scheduling off has it.
DEFAULT_SWITCH_INTERVAL_S = sys.getswitchinterval()


def workload(args: argparse.Namespace, batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed + batch)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (batch,), generator=gen)
    return [torch.randint(10, args.vocab, (int(n),), generator=gen).tolist() for n in lengths]


def make_engine(path: str, prompts: list[list[int]], args: argparse.Namespace, mode: str):
    """A KV pool that holds every request at once with room to spare (admission keeps a
    watermark and rounds each request up to whole blocks): one decode batch of B."""
    num_blocks = 2 * sum(-(-(len(p) + args.output_tokens) // 16) for p in prompts) + 64
    return Engine(
        EngineConfig(
            ModelConfig(path, device=args.device),
            CacheConfig(num_blocks=num_blocks, block_size=16),
            SchedulerConfig(
                max_num_batched_tokens=args.token_budget,
                max_num_seqs=len(prompts),
                async_scheduling=mode == "async",
            ),
        )
    )


def run_once(path: str, prompts: list[list[int]], args: argparse.Namespace, mode: str) -> dict:
    sys.setswitchinterval(DEFAULT_SWITCH_INTERVAL_S)
    engine = make_engine(path, prompts, args, mode)
    assert engine.async_scheduling == (mode == "async")
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    requests = [Request(prompt_token_ids=p, sampling=params) for p in prompts]
    start = time.perf_counter()
    outputs = engine.generate(requests)
    wall = time.perf_counter() - start
    steps, times = engine.num_steps, engine.times
    host_ms = 1e3 * times.host_s / steps
    exposed_ms = 1e3 * times.forward_idle_s / (steps - 1)  # gaps between forwards
    return {
        "wall_s": wall,
        "steps": steps,
        "output_tok_per_s": len(prompts) * args.output_tokens / wall,
        "host_ms_per_step": host_ms,
        "forward_ms_per_step": 1e3 * times.forward_s / steps,
        "forward_cpu_ms_per_step": 1e3 * times.forward_cpu_s / steps,
        "step_ms": 1e3 * wall / steps,
        "exposed_ms_per_step": exposed_ms,
        "hidden_share": max(0.0, 1.0 - exposed_ms / host_ms) if mode == "async" else 0.0,
        "wait_ms_per_step": 1e3 * times.wait_s / steps,
        "token_ids": [o.token_ids for o in outputs],
    }


def measure(path: str, args: argparse.Namespace, batch: int) -> dict:
    """Interleaved rounds of both modes at one batch size; medians and the raw runs."""
    prompts = workload(args, batch)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            runs[mode].append(run_once(path, prompts, args, mode))
            print(f"  batch {batch} round {r + 1} {mode}: {runs[mode][-1]['wall_s']:.2f}s")
    reference = runs["sync"][0].pop("token_ids")
    for run in [r for mode in MODES for r in runs[mode]]:
        ids = run.pop("token_ids", reference)
        if ids != reference:
            raise SystemExit(f"batch {batch}: async and sync outputs differ")
    keys = [k for k in runs["sync"][0] if k != "steps"]
    medians = {
        mode: {k: statistics.median(r[k] for r in runs[mode]) for k in keys} for mode in MODES
    }
    for mode in MODES:
        medians[mode]["steps"] = runs[mode][0]["steps"]
    return {"batch": batch, "median": medians, "runs": runs, "outputs_identical": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="batch 16, one round, 16 tokens")
    p.add_argument("--name", default="async_scheduling")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.rounds, args.output_tokens = [16], 1, 16
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        make_text_checkpoint(
            tmp, "llama", hidden=args.hidden, layers=args.layers, heads=args.heads,
            kv_heads=args.kv_heads, vocab=args.vocab, intermediate_size=2 * args.hidden,
        )  # fmt: skip
        run_once(tmp, workload(args, 8), args, "async")  # warm-up: lazy init, kernel build
        for batch in args.batches:
            results.append(measure(tmp, args, batch))
    load_after = os.getloadavg()
    rows = []
    for res in results:
        sync, fast = res["median"]["sync"], res["median"]["async"]
        for mode, m in (("sync", sync), ("async", fast)):
            rows.append({"batch": res["batch"], "mode": mode, **m})
        res["async_speedup"] = sync["wall_s"] / fast["wall_s"]
    columns = ["batch", "mode", "steps", "wall_s", "output_tok_per_s", "host_ms_per_step",
               "forward_ms_per_step", "step_ms", "exposed_ms_per_step", "hidden_share"]  # fmt: skip
    print(table(rows, columns))
    for res in results:
        print(f"batch {res['batch']}: async {res['async_speedup']:.2f}x sync (wall, median)")
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    result = {
        "workload": {k: getattr(args, k) for k in ("batches", "rounds", "min_prompt",
                     "max_prompt", "output_tokens", "token_budget", "seed", "threads")},
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "vocab")},
        "environment": environment(torch.device(args.device)),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "results": results,
    }  # fmt: skip
    print(f"wrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()

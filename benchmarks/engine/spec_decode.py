"""n-gram speculative decoding under load: off, adaptive and fixed γ in one run (article §15).

The question it answers: may adaptive speculation be on by default? Only if it is never
slower than speculation off at any load. So each workload runs at several loads (requests
in flight at once: 1, 2, 8, 32, 64), with every configuration on the same requests, in
interleaved rounds (rotating order, so drifting machine load hits all alike); the table
shows median tokens/s over the rounds and the ratio to off, in wall time and in process
CPU time (on a shared host wall time swings with other people's work; CPU time much less).

  copy   copy-heavy prompts (a passage given twice, then its start), greedy: drafts are
         often right, so speculation can pay where the batch is below the ridge B*.
  open   open-ended prompts (random words), sampling at temperature 1: drafts are mostly
         wrong, the case where speculation costs and the adaptive policy must gate it.

`adaptive` is what `--speculative-tokens N` gives (n-gram min_n 2, max_n 4); on `open`,
`adaptive n1` (`--speculative-ngram-min 1`) also runs: the most eager proposer, whose
mostly wrong drafts the policy has to switch off. `fixed γ` (always γ_max, the ridge
ignored) runs at the two extreme cells for contrast.

The model is a random decoder (~28M parameters by default) built with
`make_text_checkpoint`: on a random model, copy-heavy prompts make greedy output loop,
which is what lets n-gram drafts be accepted; read `copy` as "what the machinery delivers
when drafts are right", not as a prediction for a trained model on real text.

    .venv/bin/python -m benchmarks.engine.spec_decode [--quick]

Prints the load average before and after (the host may be shared) and writes
benchmarks/results/spec_decode.json (`--dtype bfloat16`: spec_decode_bf16.json, B* then
calibrated in bfloat16).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib.common import write_result
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.sample.verify import ridge_batch_for
from vlmserve.worker.models.quantized import weight_bytes
from vlmserve.worker.models.random_checkpoint import NUM_FILLER_WORDS, make_text_checkpoint

FILLER = [f"w{i}" for i in range(NUM_FILLER_WORDS)]


def copy_heavy_prompts(num: int, rng: random.Random) -> list[str]:
    """'Repeat the text' style: a passage of random words, given twice, then its start."""
    prompts = []
    for _ in range(num):
        passage = " ".join(rng.choice(FILLER) for _ in range(rng.randint(24, 40)))
        prompts.append(f"please repeat this : {passage} . {passage} . {passage[:40]}")
    return prompts


def open_ended_prompts(num: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(FILLER) for _ in range(rng.randint(16, 48))) for _ in range(num)]


def make_engine(path: Path, spec: SpeculativeConfig, max_num_seqs: int, dtype: str) -> Engine:
    return Engine(
        EngineConfig(
            ModelConfig(str(path), dtype=dtype),
            CacheConfig(num_blocks=1024, block_size=16),
            SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max_num_seqs),
            speculative=spec,
        )
    )


def run(engine: Engine, prompts: list[str], params: SamplingParams, batch: int) -> dict:
    """Run `prompts` `batch` at a time (each group to completion); wall time, tokens and
    forward passes."""
    policy = engine.scheduler.spec_policy
    if policy is not None:  # per-run counters
        policy.num_proposed_tokens = policy.num_accepted_tokens = policy.num_verifications = 0
    start_steps, num_tokens = engine.num_steps, 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        requests = [Request(prompt=p, sampling=params) for p in prompts[i : i + batch]]
        outputs = engine.generate(requests)
        num_tokens += sum(len(o.token_ids) for o in outputs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    metrics = engine.spec_metrics
    return {
        "wall_s": wall,
        "cpu_s": cpu,  # this process's CPU time: less disturbed by other load on the host
        "output_tokens": num_tokens,
        "forward_passes": engine.num_steps - start_steps,
        "proposed": metrics.num_proposed_tokens if metrics else 0,
        "accepted": metrics.num_accepted_tokens if metrics else 0,
    }


def summarise(runs: list[dict]) -> dict:
    """Medians over the rounds (tokens and passes are the same every round)."""
    first = runs[0]
    wall = statistics.median(r["wall_s"] for r in runs)
    cpu = statistics.median(r["cpu_s"] for r in runs)
    proposed, accepted = first["proposed"], first["accepted"]
    return {
        "median_wall_s": wall,
        "median_cpu_s": cpu,
        "wall_s_all": [round(r["wall_s"], 4) for r in runs],
        "output_tokens": first["output_tokens"],
        "forward_passes": first["forward_passes"],
        "tokens_per_s": first["output_tokens"] / wall,
        "tokens_per_pass": first["output_tokens"] / first["forward_passes"],
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / max(1, proposed),
    }


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_table(cells: dict[str, dict[str, dict]]) -> None:
    print(f"\n{'workload':<10}{'load':>5}  {'config':<12}{'tok/s':>9}{'tok/pass':>10}"
          f"{'proposed':>10}{'accept':>8}{'vs off':>8}{'cpu vs off':>11}")  # fmt: skip
    for cell, results in cells.items():
        workload, load = cell.split("@")
        off = results["off"]
        for name, r in results.items():
            print(
                f"{workload:<10}{load:>5}  {name:<12}{r['tokens_per_s']:>9.1f}"
                f"{r['tokens_per_pass']:>10.2f}{r['proposed']:>10}{r['acceptance_rate']:>8.2f}"
                f"{off['median_wall_s'] / r['median_wall_s']:>7.2f}x"
                f"{off['median_cpu_s'] / r['median_cpu_s']:>10.2f}x"
            )
    print("tok/s: median over rounds; vs off: median wall-time ratio (> 1: faster than off);"
          " cpu: the same in process CPU time")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer loads, tokens and rounds")
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--gamma", type=int, default=4, help="γ_max (--speculative-tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    # One thread: on a shared 2-core machine, multi-threaded small GEMMs stall on busy
    # cores (a 5-row matmul measured 30x slower than with one thread).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--name", default=None, help="spec_decode (bfloat16: spec_decode_bf16)")
    args = parser.parse_args()
    result_name = args.name or ("spec_decode_bf16" if args.dtype == "bfloat16" else "spec_decode")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    loads = [1, 8, 64] if args.quick else [1, 2, 8, 32, 64]
    rounds = 1 if args.quick else args.rounds
    copy_tokens, open_tokens = (32, 16) if args.quick else (64, 32)
    print(f"load average before: {load_average()} ({os.cpu_count()} CPUs)")
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        path = make_text_checkpoint(
            tmp, "llama", hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
            kv_heads=2, vocab=256,
        )  # fmt: skip
        # B* for this CPU, measured once so that every engine gates on the same ridge.
        ridge = ridge_batch_for(torch.device("cpu"), getattr(torch, args.dtype))
        specs = {
            "off": SpeculativeConfig(num_speculative_tokens=0),
            "adaptive": SpeculativeConfig(args.gamma, ridge_batch=ridge),
            # The most eager proposer (--speculative-ngram-min 1): open-ended text then gets
            # drafts, mostly wrong, which the policy has to switch off.
            "adaptive n1": SpeculativeConfig(args.gamma, min_n=1, ridge_batch=ridge),
            "fixed γ": SpeculativeConfig(args.gamma, adaptive=False),
        }
        engines = {n: make_engine(path, spec, max(loads), args.dtype) for n, spec in specs.items()}
        # (oneDNN-packed linears hold their weights as buffers, not parameters)
        num_params, _ = weight_bytes(engines["off"].runner.model.decoder)
        for engine in engines.values():  # warm-up: first-call allocations out of the timing
            run(engine, [" ".join(FILLER[:8])], SamplingParams(max_tokens=4, temperature=0.0), 1)
        workloads = {
            "copy": (copy_heavy_prompts, SamplingParams(
                max_tokens=copy_tokens, temperature=0.0, ignore_eos=True)),
            "open": (open_ended_prompts, SamplingParams(
                max_tokens=open_tokens, temperature=1.0, seed=0, ignore_eos=True)),
        }  # fmt: skip
        cells = []  # (cell name, prompts, params, load, configs)
        for workload, (make_prompts, params) in workloads.items():
            for load in loads:
                # At least 4 requests per cell, so batch 1 is not one request's luck.
                prompts = make_prompts(max(load, 4), rng)
                names = ["off", "adaptive"] + (["adaptive n1"] if workload == "open" else [])
                if (workload, load) in (("copy", loads[0]), ("open", loads[-1])):
                    names.append("fixed γ")
                cells.append((f"{workload}@{load}", prompts, params, load, names))
        runs: dict[str, dict[str, list[dict]]] = {c[0]: {n: [] for n in c[4]} for c in cells}
        for r in range(rounds):
            for cell, prompts, params, load, names in cells:
                for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate
                    runs[cell][name].append(run(engines[name], prompts, params, load))
            print(f"round {r + 1}/{rounds} done, load average {load_average()}")
    results = {cell: {n: summarise(rs) for n, rs in by.items()} for cell, by in runs.items()}

    print(f"\nmodel: random llama, {num_params / 1e6:.1f}M parameters, {args.dtype}, CPU, "
          f"{torch.get_num_threads()} thread(s); γ_max {args.gamma}; {rounds} rounds")  # fmt: skip
    print(f"B* (ridge, measured for this CPU): {ridge:.1f} rows")
    print_table(results)
    # Wall time on a shared host swings with other people's work; process CPU time much
    # less. Both are reported; "never slower" has to hold in both to count.
    ratios = {"wall": {}, "cpu": {}}
    for cell, r in results.items():
        for name in r.keys() - {"off", "fixed γ"}:
            key = f"{cell} {name}"
            ratios["wall"][key] = r["off"]["median_wall_s"] / r[name]["median_wall_s"]
            ratios["cpu"][key] = r["off"]["median_cpu_s"] / r[name]["median_cpu_s"]
    for kind, by in ratios.items():
        worst = min(by, key=by.get)
        print(f"adaptive vs off, slowest cell by {kind} time: {worst} at {by[worst]:.2f}x")
    elapsed = time.perf_counter() - started
    print(f"load average after: {load_average()}; {elapsed:.0f} s")

    report = {
        "dtype": args.dtype,
        "model": {"hidden": args.hidden, "layers": args.layers, "num_params": num_params},
        "gamma_max": args.gamma,
        "ridge_batch": ridge,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "rounds": rounds,
        "loads": loads,
        "cells": results,
        "adaptive_vs_off_wall": ratios["wall"],
        "adaptive_vs_off_cpu": ratios["cpu"],
        "min_adaptive_vs_off_wall": min(ratios["wall"].values()),
        "min_adaptive_vs_off_cpu": min(ratios["cpu"].values()),
        "load_average_after": load_average(),
        "elapsed_s": elapsed,
    }
    print(f"\nwrote {write_result(result_name, report)}")


if __name__ == "__main__":
    main()

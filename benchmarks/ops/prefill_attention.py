"""Prefill attention on the CPU: the C++ prefill kernel ("cpu") against torch's SDPA path
("cpu-sdpa": SDPA per fresh prompt, gather + masked SDPA per chunk on a prefix).

Part 1, one layer of the offline-throughput model (12 query / 4 KV heads, head dim 64,
16-token blocks scattered over the cache): a fresh 512- and 2,048-token prompt and a
1,024-token chunk on a 1,024-token prefix, through each backend's `forward` (the K/V write
included). Outputs are checked equal first. Part 2, the whole model: the first two engine
steps of the offline workload (2,048-token prefill steps: fresh prompts, then chunks on a
prefix) in two engines that differ only in the backend, fresh token ids each round so the
prefix cache never hits.

The machine may be shared, so the main figures are CPU time of the one thread doing the
work (torch set to 1 thread, `time.thread_time`), alternating the two backends round by
round, medians; 2-thread wall times are printed beside them, with the load average.
GFLOP/s counts the causal attention's useful FLOPs (4 * head_dim * heads per visible
query-key pair).

    .venv/bin/python -m benchmarks.ops.prefill_attention
    .venv/bin/python -m benchmarks.ops.prefill_attention --rounds 3 --skip-steps
    .venv/bin/python -m benchmarks.ops.prefill_attention --dtype bfloat16   # one-layer cases
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks.engine.offline_throughput import make_engine, parse_args, workload
from benchmarks.lib.common import environment, table, write_result
from kernels.attention import AttentionBatch
from kernels.backends import select_backend
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

BACKENDS = ("cpu-sdpa", "cpu")
# (cached prefix, new tokens) of one sequence per layer case.
CASES = {"fresh 512": (0, 512), "fresh 2048": (0, 2048), "1024 on 1024": (1024, 1024)}


def layer_case(cached: int, new: int, args: argparse.Namespace, seed: int = 0):
    """q, k, v of the new tokens, a cache holding the prefix, and the step's batch."""
    gen = torch.Generator().manual_seed(seed)
    block, ctx = 16, cached + new
    num_blocks = -(-ctx // block) + 8
    table = torch.randperm(num_blocks, generator=gen)[: -(-ctx // block)].tolist()
    cache = torch.randn(2, args.kv_heads, num_blocks * block, args.head_dim, generator=gen)
    q = torch.randn(new, args.heads, args.head_dim, generator=gen)
    k, v = (torch.randn(new, args.kv_heads, args.head_dim, generator=gen) for _ in "kv")
    dtype = getattr(torch, args.dtype)
    cache, q, k, v = (x.to(dtype) for x in (cache, q, k, v))
    slots = torch.tensor([table[p // block] * block + p % block for p in range(cached, ctx)])
    return q, k, v, cache, AttentionBatch([new], [ctx], [table], block), slots


def attention_flops(cached: int, new: int, heads: int, head_dim: int) -> float:
    visible = sum(cached + i + 1 for i in range(new))  # query-key pairs under the mask
    return 4.0 * head_dim * heads * visible


def cpu_seconds(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def wall_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(fns: dict[str, Callable[[], object]], rounds: int, clock) -> dict[str, float]:
    """Median time of each fn, the fns taking turns within each round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        names = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in names:
            times[name].append(clock(fns[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def layer_rows(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cpu")
    rows = []
    for case, (cached, new) in CASES.items():
        q, k, v, cache, batch, slots = layer_case(cached, new, args)
        fns, outs = {}, {}
        for name in BACKENDS:
            backend = select_backend(device, name)
            meta = backend.build_metadata(batch, slots, device)
            inputs = (q, k, v, cache, meta, args.head_dim**-0.5)
            fns[name] = lambda b=backend, x=inputs: b.forward(*x)
            outs[name] = fns[name]()
        tol = 1e-4 if args.dtype == "float32" else 3e-2  # bf16: outputs rounded, P too
        torch.testing.assert_close(outs["cpu"], outs["cpu-sdpa"], rtol=tol, atol=tol)
        flops = attention_flops(cached, new, args.heads, args.head_dim)
        torch.set_num_threads(1)
        cpu = alternate(fns, args.rounds, cpu_seconds)
        torch.set_num_threads(args.threads)
        wall = alternate(fns, args.rounds, wall_seconds)
        rows.append({
            "case": case,
            "sdpa_ms_1t": 1e3 * cpu["cpu-sdpa"], "kernel_ms_1t": 1e3 * cpu["cpu"],
            "sdpa_gflops_1t": flops / cpu["cpu-sdpa"] / 1e9,
            "kernel_gflops_1t": flops / cpu["cpu"] / 1e9,
            "speedup_1t": cpu["cpu-sdpa"] / cpu["cpu"],
            f"sdpa_ms_{args.threads}t_wall": 1e3 * wall["cpu-sdpa"],
            f"kernel_ms_{args.threads}t_wall": 1e3 * wall["cpu"],
        })  # fmt: skip
    return rows


def prefill_steps(engine: Engine, requests, round_seed: int, steps: int, clock) -> list[float]:
    """Time the engine's first `steps` steps over `requests` (fresh ids), then abort them."""
    gen = torch.Generator().manual_seed(round_seed)
    ids = []
    for prompt, out in requests:
        tokens = torch.randint(10, 30000, (len(prompt),), generator=gen).tolist()
        params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(Request(prompt_token_ids=tokens, sampling=params)))
    times = [clock(engine.step) for _ in range(steps)]
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return times


def step_rows(args: argparse.Namespace) -> list[dict]:
    wargs = parse_args(["--skip-hf"])
    requests = workload(wargs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make_text_checkpoint(
            tmp, "llama", hidden=wargs.hidden, layers=wargs.layers, heads=wargs.heads,
            kv_heads=wargs.kv_heads, vocab=wargs.vocab, intermediate_size=wargs.intermediate,
        )  # fmt: skip
        engines = {name: make_engine(tmp, requests, wargs, name) for name in BACKENDS}
        assert all(engines[name].runner.backend.name == name for name in BACKENDS)
        for threads, clock in ((1, cpu_seconds), (args.threads, wall_seconds)):
            torch.set_num_threads(threads)
            times: dict[str, list[list[float]]] = {name: [] for name in BACKENDS}
            for r in range(args.step_rounds + 1):  # round 0 warms up
                names = BACKENDS if r % 2 == 0 else tuple(reversed(BACKENDS))
                for name in names:
                    t = prefill_steps(engines[name], requests, 1000 + r, args.steps, clock)
                    if r > 0:
                        times[name].append(t)
            for step in range(args.steps):
                med = {n: statistics.median(t[step] for t in times[n]) for n in BACKENDS}
                rows.append({
                    "step": step + 1, "threads": threads,
                    "clock": "thread cpu" if clock is cpu_seconds else "wall",
                    "sdpa_ms": 1e3 * med["cpu-sdpa"], "kernel_ms": 1e3 * med["cpu"],
                    "speedup": med["cpu-sdpa"] / med["cpu"],
                })  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--step-rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="prefill steps timed per round")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--skip-steps", action="store_true", help="only the one-layer cases")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32",
        help="q, k, v and cache dtype of the one-layer cases (bfloat16: the kernel's AVX-512 "
        "BF16 dot products where the CPU has them; writes prefill_attention_bf16.json, no "
        "engine steps)",
    )  # fmt: skip
    args = p.parse_args()
    args.skip_steps = args.skip_steps or args.dtype == "bfloat16"
    print(f"load average before: {os.getloadavg()}")
    layers = layer_rows(args)
    print(table(layers, list(layers[0])))
    steps = [] if args.skip_steps else step_rows(args)
    if steps:
        print(table(steps, list(steps[0])))
    load = os.getloadavg()
    print(f"load average after: {load}")
    result = {"environment": environment(torch.device("cpu")), "args": vars(args),
              "load_average": load, "layer": layers, "prefill_steps": steps}  # fmt: skip
    name = "prefill_attention" + ("_bf16" if args.dtype == "bfloat16" else "")
    print(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()

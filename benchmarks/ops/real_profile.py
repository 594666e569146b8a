"""A decode step of Gemma 3 270M (the real checkpoint where it is fetched, else a random one
of its shape: hidden 640, 18 layers, 4 query heads and 1 KV head of dim 256, GELU-tanh MLP,
262,144-token vocabulary, tied embeddings) at 64 running sequences in bfloat16: where the
step goes (torch.profiler: LM head, argmax / sampling, attention, linears, norms, GELU),
with this branch's kernels and without them, in the same run, interleaved.

Variants (each a few profiled steps per round, rounds interleaved, medians):
- greedy, torch: the logits, then torch.argmax over them, GELU-tanh and mul as eager ops;
- greedy, kernels: the greedy tokens from the head (`Decoder.compute_argmax`: the AMX
  head's fused argmax where calibrated, else the C++ argmax of kernels/sampling_cpu) and
  the fused GELU-tanh·mul; the "lm_head" region then holds the argmax too;
- sampled (--sampled: temperature 0.8, top-p 0.95, top-k 0 and 64 on alternate
  requests), one batch of every row as before, or batches of 8 MiB of weights.

    .venv/bin/python -m benchmarks.ops.real_profile               # 64 sequences, 2 rounds
    .venv/bin/python -m benchmarks.ops.real_profile --steps 4 --rounds 1 --sampled
Writes benchmarks/results/real_profile.json (the CPU's model, flags and load with it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import vlmserve.engine.forward_thread as forward_thread
import vlmserve.sample.sampler as sampler
from benchmarks.lib.common import environment, machine, table, write_result
from kernels import fused_ops, sampling_cpu
from vlmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams

REAL = Path.home() / ".cache" / "vlmserve" / "real" / "gemma-3-270m"
REGIONS = ("embed", "decoder_layers", "lm_head", "sampling")
# Op name fragments -> the group the step's self-CPU time is reported under (first match;
# the LM head's GEMM counts under linears: its region says how much of it is the head's).
GROUPS = (
    ("argmax", ("argmax",)),
    ("sampling", ("vlmserve_sampling", "topk", "sort", "cumsum", "searchsorted", "aten::exp",
                  "masked_fill", "amax")),
    ("attention", ("attention",)),
    ("norms", ("rms_norm",)),
    ("gelu", ("gelu",)),
    ("rope", ("rotary",)),
    ("linears", ("linear", "mkldnn", "aten::mm", "addmm", "skinny")),
)  # fmt: skip


def random_checkpoint(path: Path) -> Path:
    """A random Gemma3ForCausalLM of the 270M's shape, stored in bfloat16."""
    from vlmserve.worker.models.random_checkpoint import (
        make_gemma3_checkpoint,
        to_bfloat16_checkpoint,
    )

    make_gemma3_checkpoint(
        path / "f32", hidden=640, layers=18, heads=4, kv_heads=1, vocab=262144,
        text_only=True, head_dim=256, intermediate_size=2048, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32768,
    )  # fmt: skip
    return to_bfloat16_checkpoint(path / "f32", path / "bf16")


def make_engine(model: str, args: argparse.Namespace) -> Engine:
    tokens = args.sequences * (args.prompt + args.max_tokens)
    return Engine(
        EngineConfig(
            ModelConfig(model, device="cpu", dtype="bfloat16"),
            # every sequence at once in each KV cache group (Gemma 3 270M: 6 groups of 3
            # layers, 5 sliding and 1 global), with room to spare
            CacheConfig(num_blocks=8 * (tokens // 16 + 64), block_size=16),
            SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
        )
    )


def add_requests(engine: Engine, args: argparse.Namespace, sampled: bool) -> None:
    """`sequences` requests of `prompt` random token ids, prefilled (decode only after)."""
    gen = torch.Generator().manual_seed(0)
    for i in range(args.sequences):
        ids = torch.randint(10, 200_000, (args.prompt,), generator=gen).tolist()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        if sampled:
            params = SamplingParams(
                max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, top_k=64 * (i % 2),
                seed=i, ignore_eos=True,
            )  # fmt: skip
        engine.add_request(Request(prompt_token_ids=ids, sampling=params))
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(2):  # the decode batch's shapes met once
        engine.step()


# Seconds spent in each region, summed, by every call (profiled or not): the CPU path is
# synchronous, so a wall clock around a region times it without the profiler's overhead.
REGION_S: dict[str, float] = {}
_OPEN: set[str] = set()


def labelled(fn: Callable, name: str) -> Callable:
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if name in _OPEN:  # within the region already (the greedy head's logits path)
            return fn(*args, **kwargs)
        _OPEN.add(name)
        start = time.perf_counter()
        try:
            with record_function(name):
                return fn(*args, **kwargs)
        finally:
            _OPEN.discard(name)
            REGION_S[name] = REGION_S.get(name, 0.0) + time.perf_counter() - start

    return run


def timed_steps(engine: Engine, steps: int) -> dict:
    """ms a step and each region's ms, by the wall clock, without the profiler (which
    inflates some ops: the AMX LM head ran 2x as long under it on an AMX Xeon)."""
    REGION_S.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    regions = {k: round(v / steps * 1e3, 2) for k, v in REGION_S.items()}
    return {"ms_per_step": wall / steps * 1e3, "region_ms_per_step": regions,
            "lm_head_share": regions.get("lm_head", 0.0) / (wall / steps * 1e3)}  # fmt: skip


def label_regions(engine: Engine) -> None:
    decoder = engine.runner.model.decoder
    decoder.embed = labelled(decoder.embed, "embed")
    decoder.forward = labelled(decoder.forward, "decoder_layers")
    decoder.compute_logits = labelled(decoder.compute_logits, "lm_head")
    decoder.compute_argmax = labelled(decoder.compute_argmax, "lm_head")  # greedy: + argmax


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """This branch's kernels on ("kernels", "batches") or the ops they replaced ("torch",
    "one_batch"), for the duration."""
    saved = (sampler.sampling_cpu.argmax, fused_ops.gelu_tanh_and_mul, sampler.BATCH_BYTES,
             forward_thread.takes_argmax)  # fmt: skip
    if name == "torch":
        forward_thread.takes_argmax = lambda samplers: False  # logits, then the sampler
        sampler.sampling_cpu.argmax = sampling_cpu.argmax_eager
        fused_ops.gelu_tanh_and_mul = lambda gate_up, fused: fused_ops.gelu_tanh_and_mul_eager(
            gate_up
        )
    if name == "one_batch":
        sampler.BATCH_BYTES = 1 << 62
    try:
        yield
    finally:
        sampling_cpu.argmax, fused_ops.gelu_tanh_and_mul, sampler.BATCH_BYTES = saved[:3]
        forward_thread.takes_argmax = saved[3]


def group_of(op: str) -> str:
    low = op.lower()
    return next((g for g, keys in GROUPS if any(k in low for k in keys)), "other")


def profiled_steps(engine: Engine, steps: int, top: int) -> dict:
    """ms a step, each region's share of the wall time, the ops' self-CPU by group, the
    top ops."""
    start, cpu = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    events = [e for e in prof.key_averages() if e.key not in REGIONS]
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total
    regions = {e.key: e.cpu_time_total / 1e3 / steps for e in prof.key_averages()
               if e.key in REGIONS}  # fmt: skip
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "ms_per_step": wall / steps * 1e3,
        # CPU time of every thread: less noisy than the wall time on a shared machine
        "cpu_ms_per_step": cpu / steps * 1e3,
        "region_ms_per_step": {k: round(v, 2) for k, v in regions.items()},
        "group_self_share": {k: round(v / total, 3) for k, v in sorted(groups.items())},
        "ops": [
            {
                "op": e.key,
                "self_share": round(e.self_cpu_time_total / total, 3),
                "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2),
                "calls": e.count,
            }
            for e in ranked
        ],  # fmt: skip
    }


def run_workload(model: str, args: argparse.Namespace, sampled: bool) -> dict:
    engine = make_engine(model, args)
    add_requests(engine, args, sampled)
    label_regions(engine)
    names = ("one_batch", "batches") if sampled else ("torch", "kernels")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    timed: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            with variant(name):
                timed[name].append(timed_steps(engine, args.steps))
                runs[name].append(profiled_steps(engine, args.steps, args.top))
    out = {"running": len(engine.scheduler.running), "variants": {}}
    for name, parts in runs.items():
        last = parts[-1]
        out["variants"][name] = {
            "ms_per_step_median": statistics.median(p["ms_per_step"] for p in parts),
            "ms_per_step_rounds": [round(p["ms_per_step"], 1) for p in parts],
            "cpu_ms_per_step_median": statistics.median(p["cpu_ms_per_step"] for p in parts),
            **{k: last[k] for k in ("region_ms_per_step", "group_self_share", "ops")},
            "unprofiled": {
                "ms_per_step_median": statistics.median(t["ms_per_step"] for t in timed[name]),
                "lm_head_share_median": statistics.median(t["lm_head_share"] for t in timed[name]),
                "region_ms_per_step": timed[name][-1]["region_ms_per_step"],
            },
        }
    before, after = (out["variants"][n]["ms_per_step_median"] for n in names)
    out["speedup"] = before / after
    before, after = (out["variants"][n]["cpu_ms_per_step_median"] for n in names)
    out["cpu_time_ratio"] = before / after
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help=f"default: {REAL} if there, else random")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens a sequence")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=8, help="profiled decode steps a round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--sampled", action="store_true", help="also the sampled workload")
    p.add_argument("--name", default="real_profile")
    args = p.parse_args(argv)
    load = os.getloadavg()
    result: dict = {"environment": environment(torch.device("cpu")), "machine": machine(),
                    "dtype": "bfloat16", "load_average_before": load}  # fmt: skip
    print(f"{result['machine']['cpu']}, {torch.get_num_threads()} threads, load {load}")
    forward_thread.sample_plan = labelled(forward_thread.sample_plan, "sampling")
    forward_thread.greedy_plan = labelled(forward_thread.greedy_plan, "sampling")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (str(REAL) if (REAL / "config.json").exists() else None)
        result["model"] = model or "random Gemma 3 270M shape"
        model = model or str(random_checkpoint(Path(tmp)))
        for kind in ("greedy", "sampled") if args.sampled else ("greedy",):
            result[kind] = part = run_workload(model, args, kind == "sampled")
            print(f"\n{kind}, {part['running']} running: speedup {part['speedup']:.2f}x, "
                  f"CPU time {part['cpu_time_ratio']:.2f}x")  # fmt: skip
            for name, v in part["variants"].items():
                print(f"  {name}: {v['ms_per_step_median']:.1f} ms/step "
                      f"(CPU {v['cpu_ms_per_step_median']:.1f} ms) "
                      f"{v['ms_per_step_rounds']}; regions {v['region_ms_per_step']}; "
                      f"groups {v['group_self_share']}")  # fmt: skip
                print(table(v["ops"][:8], ["op", "self_share", "ms_per_step", "calls"]))
                u = v["unprofiled"]
                ms, share = u["ms_per_step_median"], u["lm_head_share_median"]
                print(f"  {name}, unprofiled: {ms:.1f} ms/step, LM head {share:.0%}; "
                      f"regions {u['region_ms_per_step']}")  # fmt: skip
    result["load_average_after"] = os.getloadavg()
    print(f"\nwrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()

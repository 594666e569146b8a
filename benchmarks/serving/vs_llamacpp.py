"""vlmserve against llama.cpp on the same GGUF file (issue 39): the real checkpoint
(Google's Gemma 3 270M, Q4_K_M), the same prompt token ids, greedy, EOS ignored.

    .venv/bin/python -m benchmarks.serving.vs_llamacpp              # 2 interleaved rounds
    .venv/bin/python -m benchmarks.serving.vs_llamacpp --quick      # 1 round, fewer requests
    .venv/bin/python -m benchmarks.serving.vs_llamacpp --scenarios batch1 --rounds 6 \
        --name vs_llamacpp_batch1                                   # batch 1 only, more rounds

Contenders, each a fresh process per round, rounds interleaved:
- `llamacpp`: llama-cpp-python (llama.cpp built from source for this CPU's instruction
  sets, benchmarks/lib/llamacpp/), the file's blocks, every core;
- `vlmserve_gguf`: our engine running the file's blocks (`--quantization gguf`);
- `vlmserve_bf16`: our engine on the file dequantized to bfloat16 (`--quantization none`;
  float32 where the CPU has no native bfloat16): the dense baseline.
Scenarios: `batch1`, requests one at a time (one chat user: TTFT and TPOT, medians);
`c8` and `c64`, 8 and 64 requests submitted at once (output tokens a second).
llama-cpp-python decodes one sequence at a time (neither its API nor its server batches
requests), so at 8 and 64 it serves them in turn: that is what its users get.

Writes benchmarks/results/vs_llamacpp.json: per contender and scenario the median over
rounds, the ratios the issue sets, greedy agreement with llama.cpp, resident memory after
load, the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import vlmserve
from benchmarks.lib import llamacpp
from benchmarks.lib.common import machine, table, write_result

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "benchmarks" / "lib" / "llamacpp" / "worker.py"
CONTENDERS = ("llamacpp", "vlmserve_gguf", "vlmserve_bf16")
SCENARIOS = ("batch1", "c8", "c64")
MAX_MODEL_LEN = 2048


def write_spec(path: Path, quick: bool, seed: int = 0, only: tuple[str, ...] = ()) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.lib.real_model import fetch_gguf, fetch_hf_dir
    from benchmarks.lib.vs_vllm_workloads import real_corpus_ids

    gguf = fetch_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(fetch_hf_dir()))
    corpus = real_corpus_ids(tokenizer)
    rng = random.Random(seed)

    def draw(n: int, low: int, high: int, out: tuple[int, int]) -> list[dict]:
        items = []
        for _ in range(n):
            length = rng.randint(low, high)
            start = rng.randrange(len(corpus) - length)
            ids = [tokenizer.bos_token_id] + corpus[start : start + length - 1]
            items.append({"prompt_token_ids": ids, "max_tokens": rng.randint(*out)})
        return items

    scenarios = {  # SCENARIOS
        "batch1": draw(3 if quick else 8, 128, 512, (128, 128)),
        "c8": draw(8, 128, 512, (64, 128)),
        "c64": draw(16 if quick else 64, 128, 512, (64, 128)),
    }
    if only:  # the same draws, some scenarios left out
        scenarios = {name: items for name, items in scenarios.items() if name in only}
    spec = {
        "gguf": str(gguf),
        "max_model_len": MAX_MODEL_LEN,
        "threads": len(os.sched_getaffinity(0)),
        "warmup": draw(2, 32, 64, (4, 4)),
        "scenarios": scenarios,
    }
    path.write_text(json.dumps(spec))
    return spec


def vlmserve_worker(spec_path: str, result_path: str, quantization: str) -> None:
    """Our side: one engine, the scenarios in turn; TTFT and TPOT from the step loop."""
    from scheduler.config import CacheConfig, SchedulerConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    start = time.perf_counter()
    model = ModelConfig(spec["gguf"], quantization=quantization, max_model_len=MAX_MODEL_LEN)
    engine = Engine(EngineConfig(
        model, CacheConfig(block_size=16, memory_bytes=1 << 30),
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64),
    ))  # fmt: skip
    load_s = time.perf_counter() - start
    from vlmserve.worker.models.quantized import weight_bytes

    weights_mib = weight_bytes(engine.runner.model.decoder)[1] / 2**20

    def request(item: dict) -> Request:
        sampling = SamplingParams(max_tokens=item["max_tokens"], temperature=0.0, ignore_eos=True)
        return Request(prompt_token_ids=item["prompt_token_ids"], sampling=sampling)

    def run(items: list[dict]) -> tuple[list[list[int]], list[float], list[float]]:
        begin = time.perf_counter()
        ids = [engine.add_request(request(item)) for item in items]
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter() - begin
                if out.error:
                    raise SystemExit(f"vlmserve refused a request: {out.error}")
                if out.token_ids and out.request_id not in first:
                    first[out.request_id] = now
                if out.finished:
                    last[out.request_id], tokens[out.request_id] = now, list(out.token_ids)
        tpot = [(last[i] - first[i]) / max(1, len(tokens[i]) - 1) for i in ids]
        return [tokens[i] for i in ids], [first[i] for i in ids], tpot

    run(spec["warmup"])
    result = {"system": f"vlmserve_{quantization}", "load_s": load_s, "scenarios": {},
              "weights_mib": weights_mib, "rss_after_load_mib": rss_mib("VmRSS"),
              "weight_format": model.weight_format, "dtype": str(model.torch_dtype)}  # fmt: skip
    for name, items in spec["scenarios"].items():
        start = time.perf_counter()
        if name == "batch1":  # one at a time, as llama.cpp serves them
            runs = [run([item]) for item in items]
            tokens = [r[0][0] for r in runs]
            ttft, tpot = [r[1][0] for r in runs], [r[2][0] for r in runs]
        else:
            tokens, ttft, tpot = run(items)
        result["scenarios"][name] = {
            "seconds": time.perf_counter() - start, "output_token_ids": tokens,
            "ttft_s": ttft, "tpot_s": tpot,
        }  # fmt: skip
    Path(result_path).write_text(json.dumps(result))


def rss_mib(field: str = "VmHWM", pid: int | str = "self") -> float:
    """A process's resident memory (VmHWM: its peak; VmRSS: now) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_contender(name: str, spec_path: Path, workdir: Path, tag: str, python: Path) -> dict:
    result_path, log_path = workdir / f"{tag}.json", workdir / f"{tag}.log"
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    if name == "llamacpp":
        env.pop("PYTHONPATH", None)
        cmd = [str(python), str(WORKER), str(spec_path), str(result_path)]
    else:
        env.update(vlmserve.ENGINE_OPENMP)
        quantization = name.removeprefix("vlmserve_").replace("bf16", "none")
        cmd = [sys.executable, "-m", "benchmarks.serving.vs_llamacpp", "--worker",
               str(spec_path), str(result_path), quantization]  # fmt: skip
    load = os.getloadavg()[0]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        peak = 0.0
        while proc.poll() is None:
            try:
                peak = max(peak, rss_mib("VmHWM", proc.pid))
            except OSError:
                pass
            time.sleep(0.5)
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"{tag} failed ({proc.returncode}): {' | '.join(tail)}; log {log_path}")
    result = json.loads(result_path.read_text())
    result.update(loadavg_before=load, peak_rss_mib=peak)
    secs = {k: round(v["seconds"], 1) for k, v in result["scenarios"].items()}
    print(f"  {tag}: {secs} s, peak RSS {peak:.0f} MiB, load before {load:.2f}", flush=True)
    return result


def summarize(runs: dict[str, list[dict]], spec: dict) -> dict:
    out: dict[str, dict] = {}
    for name, rounds in runs.items():
        out[name] = {"peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rounds)}
        if "weights_mib" in rounds[0]:  # ours: the bytes the decoder holds, RSS after load
            out[name]["weights_mib"] = rounds[0]["weights_mib"]
            out[name]["rss_after_load_mib"] = rounds[0]["rss_after_load_mib"]
        for scenario in spec["scenarios"]:
            tokens = sum(len(t) for t in rounds[0]["scenarios"][scenario]["output_token_ids"])
            seconds = statistics.median(r["scenarios"][scenario]["seconds"] for r in rounds)
            row = {"output_tok_s": tokens / seconds, "seconds": seconds}
            if scenario == "batch1":
                row["ttft_ms"] = 1e3 * statistics.median(
                    statistics.median(r["scenarios"][scenario]["ttft_s"]) for r in rounds
                )
                row["tpot_ms"] = 1e3 * statistics.median(
                    statistics.median(r["scenarios"][scenario]["tpot_s"]) for r in rounds
                )
            out[name][scenario] = row
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy outputs are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--workdir", default=None)
    p.add_argument("--name", default=None, help="result file (vs_llamacpp / _quick)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="which of batch1, c8, c64 to run (batch1 alone: more rounds in the "
                   "same time, for its TPOT ratios on a noisy machine)")  # fmt: skip
    p.add_argument("--serve", action="store_true",
                   help="the served half: llama-cpp-python's server vs vlmserve serve, one "
                   "load generator (vs_llamacpp_serve.json)")  # fmt: skip
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    contenders = [c for c in args.contenders.split(",") if c]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vs_llamacpp_"))
    workdir.mkdir(parents=True, exist_ok=True)
    python = llamacpp.ensure_venv() if "llamacpp" in contenders else Path(sys.executable)
    spec_path = workdir / "spec.json"
    only = tuple(x for x in args.scenarios.split(",") if x)
    if unknown := set(only) - set(SCENARIOS):
        p.error(f"unknown scenarios {sorted(unknown)}: choose from {', '.join(SCENARIOS)}")
    spec = write_spec(spec_path, args.quick, only=only)
    print(f"[vs_llamacpp] load average at the start: {os.getloadavg()}", flush=True)
    if args.serve:
        return serve_main(args, contenders, rounds, spec, python, workdir)
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for r in range(rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for name in order:
            runs[name].append(run_contender(name, spec_path, workdir, f"{name}_r{r}", python))
    medians = summarize(runs, spec)
    checks, ratios = {}, {}
    if {"llamacpp", "vlmserve_gguf"} <= set(medians):
        ours, peer = medians["vlmserve_gguf"], medians["llamacpp"]
        if "batch1" in spec["scenarios"]:
            ratio = ours["batch1"]["tpot_ms"] / peer["batch1"]["tpot_ms"]
            ratios["batch1_tpot_vs_llamacpp"] = ratio
            checks["batch1_tpot_le_1.1x_llamacpp"] = ratio <= 1.1
        if "c64" in spec["scenarios"]:
            ratio = ours["c64"]["output_tok_s"] / peer["c64"]["output_tok_s"]
            ratios["c64_tok_s_vs_llamacpp"] = ratio
            checks["c64_tok_s_ge_1.5x_llamacpp"] = ratio >= 1.5
            checks["greedy_identical_share_c64"] = agreement(
                runs["vlmserve_gguf"][0]["scenarios"]["c64"]["output_token_ids"],
                runs["llamacpp"][0]["scenarios"]["c64"]["output_token_ids"])  # fmt: skip
    if {"vlmserve_bf16", "vlmserve_gguf"} <= set(medians) and "batch1" in spec["scenarios"]:
        dense, ours = medians["vlmserve_bf16"]["batch1"], medians["vlmserve_gguf"]["batch1"]
        ratios["batch1_gguf_vs_bf16_speedup"] = dense["tpot_ms"] / ours["tpot_ms"]
        checks["batch1_gguf_ge_2x_bf16"] = ratios["batch1_gguf_vs_bf16_speedup"] >= 2
    gguf_mib = Path(spec["gguf"]).stat().st_size / 2**20
    if "vlmserve_gguf" in medians:
        held = medians["vlmserve_gguf"]["weights_mib"]
        ratios["gguf_weights_vs_file_size"] = held / gguf_mib
        checks["gguf_weights_le_1.2x_file"] = held <= 1.2 * gguf_mib
    rows = []
    for name, m in medians.items():
        speeds = {f"{s}_tok_s": round(m[s]["output_tok_s"], 1) for s in spec["scenarios"]}
        b1 = m.get("batch1", {})
        rows.append(
            {
                "contender": name,
                **speeds,
                "b1_ttft_ms": round(b1["ttft_ms"], 1) if b1 else "-",
                "b1_tpot_ms": round(b1["tpot_ms"], 2) if b1 else "-",
                "rss_mib": round(m["peak_rss_mib"]),
            }
        )
    print(table(rows, list(rows[0])))
    print(json.dumps({"ratios": ratios, "checks": checks}, indent=1))
    data = {
        "machine": machine(),
        "gguf": {"path": spec["gguf"], "mib": gguf_mib},
        "threads": spec["threads"],
        "scenarios": {k: len(v) for k, v in spec["scenarios"].items()},
        "rounds": rounds,
        "medians": medians,
        "ratios": ratios,
        "checks": checks,
        "runs": {
            c: [{k: v for k, v in r.items() if k != "scenarios"} for r in rs]
            for c, rs in runs.items()
        },  # fmt: skip
    }
    write_result(args.name or ("vs_llamacpp_quick" if args.quick else "vs_llamacpp"), data)
    return data


def serve_main(args, contenders: list[str], rounds: int, spec: dict, python: Path,
               workdir: Path) -> dict:  # fmt: skip
    from benchmarks.lib.llamacpp.serve import serve_round

    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for r in range(rounds):
        for name in contenders if r % 2 == 0 else contenders[::-1]:
            runs[name].append(serve_round(name, spec, python, workdir, f"{name}_serve_r{r}"))
    keys = ("output_tok_s", "ttft_ms_p50", "ttft_ms_max", "tpot_ms_p50")
    medians = {
        name: {s: {k: statistics.median(r[s][k] for r in rs) for k in keys}
               for s in spec["scenarios"]}
        for name, rs in runs.items()
    }  # fmt: skip
    rows = [{"contender": n, "scenario": s, **{k: round(v, 1) for k, v in m[s].items()}}
            for n, m in medians.items() for s in m]  # fmt: skip
    print(table(rows, list(rows[0])))
    data = {"machine": machine(), "gguf": spec["gguf"], "threads": spec["threads"],
            "scenarios": {k: len(v) for k, v in spec["scenarios"].items()},
            "rounds": rounds, "medians": medians, "runs": runs}  # fmt: skip
    write_result(args.name or "vs_llamacpp_serve", data)
    return data


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        vlmserve_worker(*sys.argv[2:5])
    else:
        main()

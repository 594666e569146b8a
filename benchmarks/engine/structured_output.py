"""Structured outputs: constrained vs unconstrained decode throughput on one engine, and
grammar compile times (cold and cached).

A random Llama (default: 4 layers, hidden 256, GQA 4/2) with a byte-level BPE tokenizer
of --vocab entries trained on the Python standard library's source (so the vocabulary has
real multi-byte tokens, as a production one has: xgrammar's mask work grows with it).
B requests (default 64) decode together for --output-tokens tokens at temperature 1:
"constrained" with a 10-field JSON schema (response_format json_schema), "free" without.
Both on the same Engine, in interleaved rounds (the order alternating), medians reported;
throughput = output tokens / wall seconds of the batch. Constrained requests may finish
early (their JSON closed), which shrinks their batch: that biases the ratio against the
constrained side. Compile: the tokenizer tables (once per engine), the schema's first
compile, and a cached lookup.

    .venv/bin/python -m benchmarks.engine.structured_output             # a quiet machine, ~3 min
    .venv/bin/python -m benchmarks.engine.structured_output --quick     # batch 16, 2 rounds
    .venv/bin/python -m benchmarks.engine.structured_output --vllm VENV # + vLLM CPU (opt-in)

--vllm runs the same workload on vLLM's CPU build with its xgrammar backend
(benchmarks/lib/structured_vllm_worker.py in that venv, built by benchmarks/lib/vllm_cpu.py
when missing): the same checkpoint, dtype and compact JSON (disable_any_whitespace), tuned
as its CPU docs say, its OpenMP threads bound to --threads cores; it is never run by
default. The result's `vllm` holds its runs, its own constrained / free ratio and
vlmserve's constrained throughput over vLLM's (target >= 1.0x).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib.common import environment, table, write_result
from scheduler.config import CacheConfig, SchedulerConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.sample.structured import StructuredOutput
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

# Ten fields of the kinds extraction schemas hold (strings, numbers, enums, arrays, nested).
SCHEMA = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "maxLength": 40},
        "invoice_id": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{6}"},
        "date": {"type": "string", "format": "date"},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
        "total": {"type": "number"},
        "num_items": {"type": "integer", "minimum": 0, "maximum": 1000},
        "paid": {"type": "boolean"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "price": {"type": "number"},
                },
                "required": ["name", "price"],
            },
            "maxItems": 20,
        },
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "notes": {"type": ["string", "null"]},
    },
    "required": ["vendor", "invoice_id", "date", "currency", "total", "num_items", "paid",
                 "items", "address", "notes"],
}  # fmt: skip
MODES = ("free", "constrained")
COMMAND = "python -m benchmarks.engine.structured_output"


def stdlib_corpus(max_bytes: int = 4 << 20) -> list[str]:
    """Source text of the standard library (deterministic for a Python version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="ignore")
        texts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return texts


def build_checkpoint(path: Path, args: argparse.Namespace) -> None:
    """The random Llama, then its tokenizer replaced by a --vocab byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    make_text_checkpoint(
        path, "llama", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
        vocab=args.vocab, tokenizer="bytes", intermediate_size=args.hidden * 3,
    )  # fmt: skip
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    core.train_from_iterator(stdlib_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(path)


def requests(batch: int, mode: str, args: argparse.Namespace) -> list[Request]:
    spec = StructuredOutput.json_schema(SCHEMA) if mode == "constrained" else None
    return [
        Request(
            prompt=f"Invoice {i}: extract the fields as JSON.",
            sampling=SamplingParams(
                max_tokens=args.output_tokens,
                temperature=1.0,
                seed=i,
                structured=spec,
                ignore_eos=True,
            ),
        )  # fmt: skip
        for i in range(batch)
    ]


def run_once(engine: Engine, batch: int, mode: str, args: argparse.Namespace) -> dict:
    reqs = requests(batch, mode, args)
    start = time.perf_counter()
    outs = engine.generate(reqs)
    wall = time.perf_counter() - start
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    tokens = sum(len(o.token_ids) for o in outs)
    if mode == "constrained":  # closed objects must parse
        for o in outs:
            if o.finish_reason == "stop":
                json.loads(o.text)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "num_closed": sum(o.finish_reason == "stop" for o in outs)}  # fmt: skip


def compile_times(engine: Engine) -> dict:
    """Seconds: tokenizer tables + first compile (cold), a cached lookup, and a second
    distinct schema's compile (tables already built)."""
    grammars = engine.grammars.get()
    start = time.perf_counter()
    grammars.submit(StructuredOutput.json_schema(SCHEMA)).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    grammars.submit(StructuredOutput.json_schema(SCHEMA)).result()
    cached = time.perf_counter() - start
    other = {**SCHEMA, "properties": {**SCHEMA["properties"], "extra": {"type": "integer"}}}
    start = time.perf_counter()
    grammars.submit(StructuredOutput.json_schema(other)).result()
    second = time.perf_counter() - start
    return {"cold_with_tokenizer_tables_s": cold, "cached_s": cached, "cold_s": second}


def make_engine(path: Path, batch: int, args: argparse.Namespace) -> Engine:
    num_blocks = 2 * batch * (-(-(16 + args.output_tokens) // 16)) + 64
    return Engine(
        EngineConfig(
            ModelConfig(str(path), device=args.device),
            CacheConfig(num_blocks=num_blocks, block_size=16),
            SchedulerConfig(max_num_batched_tokens=max(2048, batch * 32), max_num_seqs=batch,
                            async_scheduling=not args.sync),
        )
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sync", action="store_true", help="step in turn (default: async)")
    parser.add_argument("--quick", action="store_true", help="batch 16, 2 rounds, 32 tokens")
    parser.add_argument("--vllm", metavar="VENV", default=None, help="also run vLLM (opt-in)")
    parser.add_argument("--name", default="structured_output")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.rounds, args.output_tokens = 16, 2, 32
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        build_checkpoint(path, args)
        engine = make_engine(path, args.batch, args)
        compile_s = compile_times(engine)
        for mode in MODES:  # warm-up: kernels, caches
            run_once(engine, 4, mode, args)
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                runs[mode].append(run_once(engine, args.batch, mode, args))
        vllm = run_vllm(args, path, engine.runner.dtype) if args.vllm else None
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    rows = [median_row(mode, runs[mode]) for mode in MODES]
    ratio = rows[1]["tok_s"] / rows[0]["tok_s"]
    print(table(rows, ["mode", "tok_s", "wall_s", "tokens", "num_closed"]))
    print(f"constrained / free throughput: {ratio:.3f}x (target >= 0.9x)")
    print("compile: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in compile_s.items()))
    if vllm is not None:
        theirs = vllm["medians_tok_s"]
        vllm["vlmserve_over_vllm_constrained"] = rows[1]["tok_s"] / theirs["constrained"]
        print(f"vLLM {vllm['version']}: free {theirs['free']:.1f} tok/s, constrained "
              f"{theirs['constrained']:.1f} tok/s ({vllm['constrained_over_free']:.3f}x); "
              f"vlmserve / vLLM constrained: {vllm['vlmserve_over_vllm_constrained']:.3f}x "
              "(target >= 1.0x)")  # fmt: skip
    result = {
        "command": " ".join([COMMAND, *(argv or sys.argv[1:])]),
        "workload": {k: getattr(args, k) for k in ("batch", "output_tokens", "rounds", "vocab",
                                                    "hidden", "layers", "threads", "sync")},
        "schema_fields": len(SCHEMA["properties"]),
        "medians": rows, "runs": runs, "constrained_over_free": ratio,
        "compile_s": compile_s, "vllm": vllm,
        "environment": environment(torch.device(args.device)), "cpu_flags": cpu_flags(),
        "load_average_before": load_before, "load_average_after": load_after,
    }  # fmt: skip
    print(f"wrote {write_result(args.name, result)}")
    return 0


def median_row(mode: str, runs: list[dict]) -> dict:
    row = {"mode": mode}
    for key in ("tok_s", "wall_s", "tokens", "num_closed"):
        row[key] = statistics.median(r[key] for r in runs)
    return row


def cpu_flags() -> list[str]:
    """The vector flags the CPU kernels care about."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if "flags" in ln), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


def run_vllm(args: argparse.Namespace, path: Path, dtype: torch.dtype) -> dict:
    """The same workload on vLLM's CPU build (its xgrammar backend), in its own venv and
    process session, tuned as its CPU docs say, its OpenMP threads bound to as many cores
    as this engine's --threads, in this engine's dtype."""
    import vlmserve
    from benchmarks.lib import vllm_cpu

    venv = Path(args.vllm)
    python = vllm_cpu.ensure_venv(venv)
    spec = {"model": str(path), "schema": SCHEMA, "batch": args.batch,
            "output_tokens": args.output_tokens, "rounds": args.rounds,
            "dtype": str(dtype).removeprefix("torch."),
            "max_model_len": 16 * (-(-(64 + args.output_tokens) // 16))}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in vlmserve.OPENMP_DEFAULTS}
    env.update(vllm_cpu.tuned_env(venv, kv_cache_gib=1))
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    env["VLLM_CPU_OMP_THREADS_BIND"] = vllm_cpu.core_list(set(cores))
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        worker = Path(__file__).parents[1] / "lib" / "structured_vllm_worker.py"
        # Its own session: an interrupted run takes vLLM's engine process down with it.
        proc = subprocess.Popen([str(python), str(worker), str(spec_path), str(out_path)],
                                env=env, start_new_session=True)  # fmt: skip
        try:
            proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0:
            raise SystemExit(f"the vLLM worker failed (exit {proc.returncode})")
        result = json.loads(out_path.read_text())
    return {**result, "env": {k: env[k] for k in sorted(env) if k.startswith("VLLM_")}}


if __name__ == "__main__":
    sys.exit(main())

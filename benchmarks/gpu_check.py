"""The one script to run on a machine with an NVIDIA GPU (under 8 minutes).

1. the `gpu`-marked tests (device correctness: the engine against the CPU path, the
   Triton kernels compiled, FlashInfer, CUDA graphs, token-exact against torch);
2. the offline throughput benchmark on the GPU with a larger random model (bfloat16),
   engine against transformers `generate` in the same run;
2b. the bfloat16 engine (decoder, tower, KV) on the GPU against transformers in bfloat16
   (tests/vlmserve/worker/test_bf16_accuracy.py's bounds);
3. benchmarks/ops/kernels.py: decode attention's bandwidth per backend (torch, Triton,
   FlashInfer) as a share of copy bandwidth at 2k/8k/32k x batch 1/64, and decode at
   batch 1 of the same model sizes against its bandwidth bound per backend;
3b. the quantized GEMMs (kernels/quant_gpu.py, issue 39): FP8 and the GGUF tile GEMM
   against the bfloat16 matmul, ms a call at 4,096 x 4,096 and the 262,144 x 640 LM head,
   1 and 64 rows (a few seconds: its log is appended to the kernels part's);
4. a short table, printed last.

Each part runs on its own: a failing part prints its error and the rest still run (this
script's first GPU run is the first time any of it runs on a device). `--part NAME --save
DIR` runs one part and saves its result, `--summary DIR` prints the table of the saved
ones: benchmarks/device/run.sh runs each part so, in its own process under its own
timeout, with its output in a log of its own.

    python -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --part kernels --save /tmp/parts && \
        python -m benchmarks.gpu_check --summary /tmp/parts
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

MODEL = ["--layers", "24", "--hidden", "2048", "--intermediate", "5632"]


def part(name: str, fn, failures: list[str]):
    print(f"\n=== gpu_check: {name} ===", flush=True)
    try:
        return fn()
    except Exception:  # noqa: BLE001 - report it, run the other parts
        traceback.print_exc()
        failures.append(name)
        return None


def gpu_tests(timeout_s: float = 240, flashinfer: bool = False) -> int:
    """The `gpu` tests, FlashInfer's apart (`flashinfer`): its kernels compile with nvcc
    on first use, a minute or more each on a cold cache, which took the first lent run's
    whole tests part."""
    # -v: each test's outcome as it ends (a part cut off by its timeout prints no summary)
    which = "flashinfer" if flashinfer else "not flashinfer"
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "tests", "-p", "no:cacheprovider",
           "-rfEs", "--durations=10", "-k", which]  # fmt: skip
    return subprocess.run(cmd, timeout=timeout_s).returncode


def bf16_check() -> int:
    """Issue 29: the engine on the GPU in bfloat16 (decoder, SigLIP tower and connector,
    bfloat16 KV) against transformers in bfloat16: logits max-abs difference and top-1
    agreement within the bounds tests/vlmserve/worker/test_bf16_accuracy.py states."""
    import os

    # -x: the first failure's traceback at once (the first lent run timed out after four)
    cmd = [sys.executable, "-m", "pytest", "-v", "-x", "--tb=short", "-p", "no:cacheprovider",
           "tests/vlmserve/worker/test_bf16_accuracy.py"]  # fmt: skip
    env = {**os.environ, "VLMSERVE_DEVICE": "cuda"}
    return subprocess.run(cmd, timeout=300, env=env).returncode


def offline() -> dict:
    # 64 requests (128 before): the second lent H200 ran out of the part's 70 s at 128
    from benchmarks.engine.offline_throughput import main as offline_main

    return offline_main(
        [
            "--device", "cuda", "--dtype", "bfloat16", *MODEL, "--heads", "16",
            "--kv-heads", "4", "--num-requests", "64", "--token-budget", "8192",
            "--hf-batch-size", "16", "--name", "offline_throughput_gpu",
        ]
    )  # fmt: skip


def kernels() -> dict:
    from benchmarks.ops.kernels import main as kernels_main

    return kernels_main(["--device", "cuda", "--dtype", "bfloat16", *MODEL])


def nanobatch() -> dict:
    """Issue 15: benchmarks/engine/nanobatch.py on the GPU, a ~1.07B-parameter bf16 random Llama
    at a dense batch of 256 decodes (target >= 1.1x over sequential). The token budget admits
    all 256 prompts in 8 steps: at 2,048 the first finished its 33 tokens before the last was
    admitted, and no step ever had the 256 decodes it measures (the 2026-12-04 H200 run)."""
    from benchmarks.engine.nanobatch import main as nanobatch_main

    return nanobatch_main(
        [
            "--device", "cuda", "--layers", "20", "--hidden", "2048", "--heads", "16",
            "--kv-heads", "8", "--intermediate", "5632", "--vocab", "32000", "--batch", "256",
            "--prompt", "512", "--output", "33", "--token-budget", "16384",
            "--name", "nanobatch_gpu",
        ]
    )  # fmt: skip


# The quantized GEMMs timed: (out, in) of the weight, the GGUF block type it is stored in
# (the real Gemma 3 270M file keeps its 262k-row head in Q8_0), the rows multiplied.
QUANT_SHAPES = [((4096, 4096), "Q4_K"), ((262144, 640), "Q8_0")]
QUANT_ROWS = (1, 64)


def _random_blocks(qtype: str, out_features: int, in_features: int) -> torch.Tensor:
    """Random GGUF bytes on the GPU with every block's float16 scales set to a sane value
    (the speed does not depend on the values; NaNs would only obscure a broken run)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    nblocks = in_features // block
    raw = torch.randint(0, 256, (out_features, nblocks, size), dtype=torch.uint8, device="cuda")
    scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8).cuda()  # 2 bytes
    scales = 2 if qtype == "Q8_0" else 4  # Q4_K: d and dmin
    raw[..., :scales] = scale.repeat(scales // 2)
    return raw.reshape(out_features, -1)


def _cuda_ms(fn, reps: int = 20) -> float:
    """Median ms a call, CUDA events around each of `reps` calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def quant() -> dict:
    """Issue 39: y = x @ W^T with W as FP8 (kernels/quant_gpu.py's Fp8Linear: _scaled_mm
    where the GPU has it) and as GGUF blocks (the Triton tile GEMM), against the bfloat16
    matmul on the same GPU in the same run: ms a call, bfloat16 activations."""
    rows = []
    for (out_features, in_features), qtype in QUANT_SHAPES:
        rows += _time_quant_shape(out_features, in_features, qtype)
        torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(0), "rows": rows}


def _time_quant_shape(out_features: int, in_features: int, qtype: str) -> list[dict]:
    from gguf.constants import GGMLQuantizationType

    from kernels.quant_gpu import Fp8Linear, gguf_linear, quantize_fp8

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(out_features, in_features, device="cuda", generator=gen)
    dense = (weight / in_features**0.5).bfloat16()
    fp8 = Fp8Linear(*quantize_fp8(dense))
    blocks = _random_blocks(qtype, out_features, in_features)
    code = int(GGMLQuantizationType[qtype])
    out = []
    for rows in QUANT_ROWS:
        x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
        row = {"shape": f"{out_features}x{in_features}", "rows": rows, "gguf_type": qtype,
               "bf16_ms": _cuda_ms(lambda x=x: torch.nn.functional.linear(x, dense)),
               "fp8_ms": _cuda_ms(lambda x=x: fp8(x)),
               "gguf_ms": _cuda_ms(lambda x=x: gguf_linear(x, blocks, code))}  # fmt: skip
        row["fp8_path"] = fp8.describe().rsplit(", ", 1)[-1]
        print(row, flush=True)
        out.append(row)
    return out


PARTS = {"tests": gpu_tests, "bf16": bf16_check, "offline": offline, "kernels": kernels,
         "nanobatch": nanobatch, "quant": quant,
         "flashinfer": lambda: gpu_tests(flashinfer=True)}  # fmt: skip


def summary(results: dict[str, object], failures: list[str], gpu: str) -> list[str]:
    """The closing table: one line per figure of each part that produced one (a result
    this cannot read is named, not raised: the logs beside it still stand)."""
    lines = ["=== gpu_check summary ===", f"gpu                  {gpu}"]
    tests = results.get("tests")
    lines.append("gpu tests            " + ("passed" if tests == 0 else f"FAILED ({tests})"))
    for name, label in (("bf16", "bf16 accuracy"), ("flashinfer", "flashinfer tests")):
        if name in results or name in " ".join(failures):
            code = results.get(name)
            lines.append(f"{label:<21}" + ("passed" if code == 0 else f"FAILED ({code})"))
    for name, fn in (("offline", _offline_lines), ("kernels", _kernel_lines),
                     ("nanobatch", _nanobatch_lines), ("quant", _quant_lines)):  # fmt: skip
        if results.get(name) is not None:
            try:
                lines += fn(results[name])
            except (KeyError, TypeError, ValueError) as e:
                lines.append(f"{name:<20} unreadable result: {type(e).__name__}: {e}")
    lines.append(f"failed parts         {', '.join(failures) or 'none'}")
    return lines


def _offline_lines(result: dict) -> list[str]:
    lines = [f"{name[:20]:<20} {row['output_tok_per_s']:,.0f} output tok/s"
             for name, row in {r["system"]: r for r in result["rows"]}.items()]  # fmt: skip
    speedup = result["speedup_vs_transformers"]
    lines.append(f"speed-up             {speedup:.2f}x" if speedup else "speed-up             n/a")
    fraction = result["engine_roofline"]["roofline_fraction"]
    return lines + [f"roofline fraction    {fraction:.1%}"]


def _kernel_lines(kern: dict) -> list[str]:
    lines = [f"copy bandwidth       {kern['copy_gbps']:.0f} GB/s"]
    for r in kern["attention"]:
        share = f"{r['copy_fraction']:.0%}" if r.get("copy_fraction") else "n/a"
        lines.append(f"attn {r['context']:>5} x {r['batch']:<3} {r['backend']:<10} {share} of copy")
    for r in kern.get("decode_batch1", []):
        if "error" in r:
            lines.append(f"decode b1 {r['config']:<22} FAILED: {r['error'][:60]}")
        else:
            lines.append(f"decode b1 {r['config']:<22} {r['ms_per_step']:.2f} ms/step, "
                         f"{r['bound_fraction']:.0%} of the bandwidth bound")  # fmt: skip
    return lines


def _quant_lines(result: dict) -> list[str]:
    return [
        f"quant {r['shape']:>10} x{r['rows']:<3} bf16 {r['bf16_ms']:.3f} ms, fp8 "
        f"{r['fp8_ms']:.3f} ms ({r['fp8_path']}), {r['gguf_type']} {r['gguf_ms']:.3f} ms"
        for r in result["rows"]
    ]


def _nanobatch_lines(nano: dict) -> list[str]:
    return [f"nano-batch           {nano['nano_over_plain']:.2f}x sequential"]


def saved_results(folder: Path) -> tuple[dict[str, object], list[str]]:
    """The parts `--save` wrote to `folder`; a part that started and never finished (killed
    by its timeout, or its process died) counts as failed, one never started is left out."""
    results, failures = {}, []
    for name in PARTS:
        path = folder / f"{name}.json"
        if not path.exists():
            continue
        saved = json.loads(path.read_text())
        if saved.get("unfinished"):
            failures.append(f"{name} (no result: see its log)")
            continue
        results[name] = saved["result"]
        if saved["failed"]:
            failures.append(name)
    return results, failures


def _exit(results: dict[str, object], failures: list[str], tests: object) -> int:
    """1 where a part failed, the gpu tests did not pass or a pytest part returned nonzero."""
    pytest_parts = (results.get("bf16", 0), results.get("flashinfer", 0))
    return 1 if failures or tests != 0 or any(code != 0 for code in pytest_parts) else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--part",
        action="append",
        choices=list(PARTS),
        help="run only this part (repeatable; default: all, then the summary)",
    )
    p.add_argument(
        "--save", type=Path, metavar="DIR", help="write each part's result to DIR/<part>.json"
    )
    p.add_argument(
        "--summary",
        type=Path,
        metavar="DIR",
        help="print the summary of the results saved in DIR and write "
        "DIR/gpu_check.json; runs nothing",
    )
    p.add_argument("--tests-timeout-s", type=float, default=240)  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summary is not None:
        results, failures = saved_results(args.summary)
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
        print("\n".join(summary(results, failures, gpu)))
        combined = {"gpu": gpu, "failures": failures, "parts": results}
        (args.summary / "gpu_check.json").write_text(json.dumps(combined, indent=2, default=str))
        return _exit(results, failures, results.get("tests"))
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to check", file=sys.stderr)
        return 2
    start = time.perf_counter()
    failures: list[str] = []
    results: dict[str, object] = {}
    run = {**PARTS, "tests": lambda: gpu_tests(args.tests_timeout_s),
           "flashinfer": lambda: gpu_tests(args.tests_timeout_s, flashinfer=True)}  # fmt: skip
    for name in args.part or list(PARTS):
        part_start = time.perf_counter()
        saved_as = None if args.save is None else args.save / f"{name}.json"
        if saved_as is not None:  # started: stays so if its timeout kills it
            args.save.mkdir(parents=True, exist_ok=True)
            saved_as.write_text(json.dumps({"result": None, "failed": True, "unfinished": True}))
        results[name] = part(name, run[name], failures)
        if saved_as is not None:
            saved = {"result": results[name], "failed": name in failures,
                     "seconds": time.perf_counter() - part_start}  # fmt: skip
            saved_as.write_text(json.dumps(saved, default=str))
    if args.part:  # one part of run.sh's sequence: its summary comes from --summary
        return _exit(results, failures, results.get("tests", 0))
    print()
    print("\n".join(summary(results, failures, torch.cuda.get_device_name(0))))
    print(f"wall time            {time.perf_counter() - start:.0f}s")
    return _exit(results, failures, results.get("tests"))


if __name__ == "__main__":
    sys.exit(main())

"""Offline throughput: the engine against transformers `generate` in static batches.

A random ~100M-parameter Llama-family decoder (12 layers, hidden 768, GQA 12/4, vocab
32k), 64 requests with prompts of 32-1024 tokens and outputs of 16-256 (fixed seed,
ignore_eos). The baseline is what a user without a serving engine does: left-padded
static batches, each running to its longest output. Both run in this process, and the
device's matmul peak and memory bandwidth are measured in the same run for the roofline
fraction.

    .venv/bin/python -m benchmarks.engine.offline_throughput            # the full workload
    .venv/bin/python -m benchmarks.engine.offline_throughput --quick    # a smoke-sized run
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from benchmarks.lib.common import environment, matmul_peak, memory_bandwidth, table, write_result
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint


def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(args.seed)
    requests = []
    for _ in range(args.num_requests):
        prompt_len = int(torch.randint(args.min_prompt, args.max_prompt + 1, (1,), generator=gen))
        output_len = int(torch.randint(args.min_output, args.max_output + 1, (1,), generator=gen))
        ids = torch.randint(10, args.vocab, (prompt_len,), generator=gen).tolist()
        requests.append((ids, output_len))
    return requests


def make_engine(
    path: str, requests, args: argparse.Namespace, attention_backend: str | None = None,
    kv_bytes: int | None = None, speculative: SpeculativeConfig | None = None,
) -> Engine:  # fmt: skip
    """The engine the benchmark measures: a KV pool that holds every request at once (its
    blocks counted for one KV cache group), or of `kv_bytes` (the peer's KV cache size:
    a model with sliding-window layers keeps blocks for each group of layers)."""
    kv_tokens = sum(len(ids) + out for ids, out in requests)
    cache = (
        CacheConfig(num_blocks=kv_tokens // 16 + 64, block_size=16)
        if kv_bytes is None
        else CacheConfig(memory_bytes=kv_bytes, block_size=16)
    )
    return Engine(
        EngineConfig(
            ModelConfig(
                path,
                device=args.device,
                dtype=args.dtype,
                attention_backend=attention_backend or getattr(args, "attention_backend", None),
                cuda_graphs=getattr(args, "cuda_graphs", True),
            ),  # fmt: skip
            cache,
            SchedulerConfig(max_num_batched_tokens=args.token_budget, max_num_seqs=256),
            speculative or SpeculativeConfig(),
        )
    )


def run_engine(path: str, requests, args: argparse.Namespace) -> dict:
    engine = make_engine(path, requests, args)
    batch = [
        Request(
            prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
        )
        for ids, out in requests
    ]
    _sync(args.device)
    start = time.perf_counter()
    outputs = engine.generate(batch)
    _sync(args.device)
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == out for o, (_, out) in zip(outputs, requests, strict=True))
    return {"seconds": seconds, "steps": engine.num_steps, "outputs": outputs}


def run_transformers(path: str, requests, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    _sync(args.device)
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(requests), args.hf_batch_size):
        chunk = requests[i : i + args.hf_batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (ids, _) in enumerate(chunk):  # left padding, as generate expects
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        new = max(out for _, out in chunk)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids.to(args.device),
                attention_mask=mask.to(args.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        generated += out.shape[0] * (out.shape[1] - width)
    _sync(args.device)
    return {"seconds": time.perf_counter() - start, "generated_incl_waste": generated}


def roofline(requests, cfg, steps: int, seconds: float, peak: float, bandwidth: float) -> dict:
    """Lower bound on the engine's time from useful FLOPs and bytes (article §3, §10):
    2 FLOPs per non-embedding parameter per token plus attention, weights read once per
    step, each decode token reading its context's KV once."""
    per_layer = (
        cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    params = cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size  # + LM head
    elem = 4
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    flops = bytes_ = 0.0
    for ids, out in requests:
        n = len(ids)
        # Prefill: dense FLOPs + causal attention (4·L·d·N²/2); logits only for the last row.
        flops += 2 * (params - cfg.hidden_size * cfg.vocab_size) * n
        flops += 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n
        for t in range(out):
            context = n + t
            flops += 2 * params + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
            bytes_ += context * kv_per_token
    bytes_ += steps * params * elem
    bound = max(flops / peak, bytes_ / bandwidth)
    return {
        "useful_tflop": flops / 1e12,
        "bytes_gb": bytes_ / 1e9,
        "compute_bound_s": flops / peak,
        "memory_bound_s": bytes_ / bandwidth,
        "roofline_fraction": bound / seconds,
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="auto (the engine default), float32, bfloat16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--quick", action="store_true", help="16 requests, shorter prompts/outputs")
    p.add_argument("--name", default="offline_throughput")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_prompt, args.max_output = 16, 256, 64
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    requests = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        make_text_checkpoint(
            tmp, "llama", hidden=args.hidden, layers=args.layers, heads=args.heads,
            kv_heads=args.kv_heads, vocab=args.vocab, intermediate_size=args.intermediate,
        )  # fmt: skip
        peak = matmul_peak(device, torch.float32 if args.device == "cpu" else torch.bfloat16)
        bandwidth = memory_bandwidth(device)
        engine = run_engine(tmp, requests, args)
        hf = None if args.skip_hf else run_transformers(tmp, requests, args)
        from encoders.weights import read_config
        from vlmserve.worker.models.decoder import DecoderConfig

        cfg = DecoderConfig.from_hf(read_config(tmp), qkv_bias=False, tie=False)
    useful = sum(out for _, out in requests)
    rows = [{"system": "vlmserve engine", "seconds": engine["seconds"],
             "output_tok_per_s": useful / engine["seconds"], "steps": engine["steps"]}]  # fmt: skip
    if hf is not None:
        name = f"transformers generate (static batch {args.hf_batch_size})"
        rows.append({"system": name, "seconds": hf["seconds"],
                     "output_tok_per_s": useful / hf["seconds"]})  # fmt: skip
    roof = roofline(requests, cfg, engine["steps"], engine["seconds"], peak, bandwidth)
    result = {
        "workload": {k: getattr(args, k) for k in ("num_requests", "min_prompt", "max_prompt",
                     "min_output", "max_output", "seed", "token_budget", "hf_batch_size")},
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "kv_heads": args.kv_heads, "vocab": args.vocab},
        "environment": environment(device),
        "prompt_tokens": sum(len(ids) for ids, _ in requests),
        "output_tokens": useful,
        "rows": rows,
        "speedup_vs_transformers": (hf["seconds"] / engine["seconds"]) if hf else None,
        "measured_peak_tflops": peak / 1e12,
        "measured_bandwidth_gbps": bandwidth / 1e9,
        "engine_roofline": roof,
    }  # fmt: skip
    print(table(rows, ["system", "seconds", "output_tok_per_s", "steps"]))
    if hf:
        print(f"speed-up: {result['speedup_vs_transformers']:.2f}x over transformers")
    print(
        f"roofline: {roof['roofline_fraction']:.1%} of the bound (compute "
        f"{roof['compute_bound_s']:.1f}s at {peak / 1e9:.0f} GFLOP/s measured, memory "
        f"{roof['memory_bound_s']:.1f}s at {bandwidth / 1e9:.1f} GB/s measured)"
    )
    path = write_result(args.name, result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()

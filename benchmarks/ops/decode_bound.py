"""Decode at batch 1 against its bandwidth bound: one sequence's decode step must read
every weight once, so it can take no less than weight bytes / measured copy bandwidth
(article §11: at batch 1 decode is memory-bound). Reports ms per step and the bound as a
share of it. `benchmarks/gpu_check.py` runs it on the GPU; on a CPU:

    .venv/bin/python -m benchmarks.ops.decode_bound              # the offline workload's model
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from benchmarks.engine.offline_throughput import make_engine
from benchmarks.lib.common import environment, memory_bandwidth, sync_for, table, write_result
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint


def weight_bytes(engine: Engine) -> int:
    """Bytes a decode step reads from weights: the decoder's parameters and buffers (the
    embedding table only for the LM head when tied; one row of it otherwise)."""
    decoder = engine.runner.model.decoder
    tensors = {id(t): t for t in [*decoder.parameters(), *decoder.buffers()]}
    tensors |= {id(m.weight): m.weight for m in decoder.modules() if hasattr(m, "weight")}
    total = sum(t.numel() * t.element_size() for t in tensors.values() if t is not None)
    if decoder.lm_head is not None:  # the untied embedding table is read one row a token
        embed = decoder.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


def decode_batch1(path: str, device: str, dtype: str, steps: int = 32, **model: object) -> dict:
    """Median ms per decode step of one sequence (prompt 128 tokens) and the bound.
    `model`: attention_backend, cuda_graphs (ModelConfig's; default: the engine's)."""
    args = argparse.Namespace(device=device, dtype=dtype, token_budget=2048, **model)
    requests = [(list(range(10, 138)), steps + 8)]
    engine = make_engine(path, requests, args)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    engine.add_request(Request(prompt_token_ids=requests[0][0], sampling=params))
    sync = sync_for(torch.device(device))
    for _ in range(4):  # the prefill, then warm decodes
        engine.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    num_bytes = weight_bytes(engine)
    bandwidth = memory_bandwidth(torch.device(device))
    bound_s = num_bytes / bandwidth
    return {
        "ms_per_step": step_s * 1e3,
        "weight_mb": num_bytes / 1e6,
        "bandwidth_gbps": bandwidth / 1e9,
        "bound_ms": bound_s * 1e3,
        "bound_fraction": bound_s / step_s,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--name", default="decode_bound")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        make_text_checkpoint(
            tmp, "llama", hidden=args.hidden, layers=args.layers, heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=32000, intermediate_size=args.intermediate,
        )  # fmt: skip
        row = decode_batch1(tmp, args.device, args.dtype, args.steps)
    print(table([row], list(row)))
    print(f"decode at batch 1: {row['bound_fraction']:.0%} of the bandwidth bound")
    write_result(args.name, {"environment": environment(torch.device(args.device)), **row})
    return row


if __name__ == "__main__":
    main()

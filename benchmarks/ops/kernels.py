"""Decode attention bandwidth per backend, and decode at batch 1 against its bound (GPU).

Decode attention reads each sequence's whole K/V once per layer, so its speed is the bytes
it reads over the time it takes, compared here with the GPU's measured copy bandwidth (a
copy reads and writes every byte: the practical ceiling). One layer of a Llama-8B-shaped
model (32 query heads over 8 KV heads, head dim 128, bfloat16, 16-token blocks scattered
over the cache) at contexts 2k / 8k / 32k and batch 1 / 64, for the torch backend (gather
+ batched matmul, the reference), Triton and FlashInfer side by side, each checked
against the torch backend's output first. Then decode at batch 1 of the gpu_check model
as a share of its bandwidth bound (weight bytes / copy bandwidth; benchmarks/ops/decode_bound.py)
per backend: the article's §10 quotes 50-65% for vLLM, the issue's target is >= 80%.

Without a GPU it runs the correctness comparison (Triton in its interpreter against the
torch backend) and says that no GPU figure was measured.

    .venv/bin/python -m benchmarks.ops.kernels        # writes benchmarks/results/kernels.json
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
import traceback

import torch

if not torch.cuda.is_available():  # read when triton is first imported: before anything else
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.lib.common import environment, memory_bandwidth, table, write_result  # noqa: E402
from kernels.attention import AttentionBatch, TorchPagedAttention  # noqa: E402
from kernels.backends import select_backend  # noqa: E402

CONTEXTS = (2048, 8192, 32768)
BATCHES = (1, 64)


def decode_case(backend, batch: int, context: int, args, seed: int):
    """(q, k, v, cache, metadata, bytes of K/V read) for `batch` sequences of `context`
    tokens decoding one more, their blocks shuffled over the cache. The same `seed` gives
    every backend the same values (element for element where layouts agree)."""
    block, device, dtype = args.block_size, torch.device(args.device), args.torch_dtype
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    per_seq = -(-(context + 1) // block)
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    shape = backend.kv_cache_shape(num_blocks, block, args.kv_heads, args.head_dim)
    cache = torch.empty(shape, device=device, dtype=dtype).normal_(generator=None)
    q = torch.randn(batch, args.heads, args.head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, args.kv_heads, args.head_dim, device=device, dtype=dtype)
            for _ in "kv")  # fmt: skip
    slots = torch.tensor([t[context // block] * block + context % block for t in tables])
    meta = backend.build_metadata(
        AttentionBatch([1] * batch, [context + 1] * batch, tables, block), slots, device
    )
    kv_bytes = 2 * batch * (context + 1) * args.kv_heads * args.head_dim * cache.element_size()
    return q, k, v, cache, meta, kv_bytes


def timed(fn, reps: int, device: torch.device) -> float:
    """Seconds per call: back-to-back calls between two syncs (launches overlap the GPU's
    work, as in a model's layer loop), after three warm-ups (compiles, plans)."""
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def backends(args) -> dict[str, object]:
    """The backends this machine runs, by name; the reason for each it does not."""
    found: dict[str, object] = {"torch": TorchPagedAttention()}
    for name in ("triton", "flashinfer"):
        try:
            found[name] = select_backend(torch.device(args.device), name, args.torch_dtype)
        except ValueError as e:
            found[name] = str(e)
    return found


def attention_rows(args, copy_bw: float | None) -> tuple[list[dict], dict]:
    """One row per (context, batch, backend): max error against torch, time, bandwidth."""
    rows, skipped = [], {}
    device = torch.device(args.device)
    available = backends(args)
    for name, b in available.items():
        if isinstance(b, str):
            skipped[name] = b
    scale = args.head_dim**-0.5
    for context in args.contexts:
        for batch in args.batches:
            reference = None
            for name, backend in available.items():
                if isinstance(backend, str):
                    continue
                case = decode_case(backend, batch, context, args, seed=context + batch)
                q, k, v, cache, meta, kv_bytes = case
                if not isinstance(backend, TorchPagedAttention):
                    meta = _on(meta, device)
                out = backend.forward(q, k, v, cache, meta, scale)
                if reference is None:
                    reference = out.float()
                row = {"context": context, "batch": batch, "backend": name}
                call = None
                if device.type == "cuda":  # interpreter timings on a CPU mean nothing
                    call = functools.partial(backend.forward, q, k, v, cache, meta, scale)
                    seconds = timed(call, args.reps, device)
                    row |= {"us": seconds * 1e6, "gbps": kv_bytes / seconds / 1e9,
                            "copy_fraction": kv_bytes / seconds / copy_bw}  # fmt: skip
                # FlashInfer's layout differs, so its cache holds other values: it is
                # checked against torch in the gpu tests (test_flashinfer.py) instead.
                row["max_err_vs_torch"] = (
                    float((out.float() - reference).abs().max()) if name != "flashinfer" else None
                )
                rows.append(row)
                del q, k, v, cache, meta, out, case, call
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows, skipped


def _on(meta, device: torch.device):
    from vlmserve.worker.runner import _to_device

    return meta if device.type == "cpu" else _to_device(meta, device)


def decode_bound_rows(args) -> list[dict]:
    """Decode at batch 1 of a random Llama-shaped model per backend (and Triton with and
    without CUDA graphs), as a share of weight bytes / copy bandwidth."""
    from benchmarks.ops.decode_bound import decode_batch1
    from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make_text_checkpoint(
            tmp, "llama", hidden=args.hidden, layers=args.layers, heads=16, kv_heads=4,
            vocab=32000, intermediate_size=args.intermediate,
        )  # fmt: skip
        configs = [("torch", {"attention_backend": "torch", "cuda_graphs": False}),
                   ("triton, eager", {"attention_backend": "triton", "cuda_graphs": False}),
                   ("triton + CUDA graphs", {"attention_backend": "triton"}),
                   ("flashinfer", {"attention_backend": "flashinfer"})]  # fmt: skip
        for name, model in configs:
            try:
                row = decode_batch1(tmp, args.device, args.dtype, args.steps, **model)
                rows.append({"config": name, **row})
            except Exception as e:  # noqa: BLE001 - one failing backend: say why, go on
                rows.append({"config": name, "error": f"{type(e).__name__}: {e}"})
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    p.add_argument("--dtype", default="bfloat16" if gpu else "float32")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--reps", type=int, default=20)
    # decode at batch 1: gpu_check's model
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args(argv)
    if args.device == "cpu":  # the interpreter (TRITON_INTERPRET=1, set above): small
        args.contexts, args.batches, args.reps = [300], [4], 1
        args.heads, args.kv_heads, args.head_dim = 8, 2, 64
    args.torch_dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    result: dict = {"environment": environment(device), "args": vars(args) | {"torch_dtype": None}}
    copy_bw = memory_bandwidth(device, 2 << 30) if device.type == "cuda" else None
    result["copy_gbps"] = copy_bw / 1e9 if copy_bw else None
    rows, skipped = attention_rows(args, copy_bw)
    result |= {"attention": rows, "skipped": skipped}
    columns = ["context", "batch", "backend", "us", "gbps", "copy_fraction", "max_err_vs_torch"]
    print(table(rows, columns))
    for name, why in skipped.items():
        print(f"{name}: not run ({why})")
    if device.type == "cuda":
        write_result("kernels", result)  # kept if the decode rows run out of time
        try:
            result["decode_batch1"] = decode_bound_rows(args)
            print(table(result["decode_batch1"], sorted({k for r in result["decode_batch1"]
                                                         for k in r}, key=str)))  # fmt: skip
        except Exception:  # noqa: BLE001 - the attention figures above still stand
            result["decode_batch1_error"] = traceback.format_exc()
            print(result["decode_batch1_error"])
    else:
        result["gpu_figures"] = "not measured: no CUDA device (correctness only, interpreter)"
        print(result["gpu_figures"])
    path = write_result("kernels", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()

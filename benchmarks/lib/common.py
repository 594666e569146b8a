"""Shared benchmark helpers: measured device peaks, result writing, tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent.parent / "results"


def median_time(fn: Callable[[], object], repeat: int = 5, sync: Callable[[], None] = lambda: None):
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync_for(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048) -> float:
    """Measured dense matmul FLOP/s (median of several runs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    seconds = median_time(lambda: a @ b, repeat=7, sync=sync_for(device))
    return 2 * n**3 / seconds


def memory_bandwidth(device: torch.device, num_bytes: int = 512 << 20) -> float:
    """Measured copy bandwidth in bytes/s (a copy reads and writes every byte)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = median_time(lambda: dst.copy_(src), repeat=7, sync=sync_for(device))
    return 2 * num_bytes / seconds


def environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def machine() -> dict:
    """The CPU a result was measured on: machines of one kind differ between sessions
    (AVX-512 with AMX on one, AVX2 only on another), and the kernels with them."""
    from kernels.cpu_build import cpu_features

    pairs = (line.split(":", 1) for line in cpu_features().splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}
    flags = set(fields.get("flags", "").split())
    isa = next((name for name in ("avx512f", "avx2") if name in flags), "other")
    return {
        "cpu": fields.get("model name", platform.processor()),
        "vector_isa": isa.removesuffix("f"),
        "amx": "amx_tile" in flags,
        "cores": os.cpu_count(),
    }


def write_result(name: str, data: dict) -> Path:
    """benchmarks/results/`name`.json, with the machine it was measured on."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True))
        )
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return "" if value is None else str(value)

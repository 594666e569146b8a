"""Shared benchmark helpers: measured device peaks, result writing, tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent.parent / "results"
REPO = Path(__file__).resolve().parents[2]
# The instruction-set extensions the kernels (ours, oneDNN's, vLLM's) choose their paths by.
CPU_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "bf16", "i8mm",
)  # fmt: skip


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
    from kernels import isa_target
    from kernels.cpu_build import cpu_features

    pairs = (line.split(":", 1) for line in cpu_features().splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}
    flags = set(fields.get("flags", "").split())
    isa = next((name for name in ("avx512f", "avx2") if name in flags), "other")
    flags |= set(fields.get("Features", "").split())  # an Arm CPU's list
    target = isa_target()
    return {
        "cpu": fields.get("model name", platform.processor()),
        "vector_isa": isa.removesuffix("f"),
        "amx": "amx_tile" in flags,
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "cores": os.cpu_count(),
        **({"isa_target": f"{target} (VLMSERVE_ISA on this CPU)"} if target else {}),
    }


def command() -> str:
    """The command line that runs this program again (`python -m NAME ...` for a module)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        argv = ["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    else:
        argv = ["python", *sys.argv]
    return shlex.join(argv)


def git_revision(repo: Path = REPO) -> dict:
    """The checkout's commit and whether tracked files differ from it (result files aside:
    a program may have written its own before); commit None outside a git checkout."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                  text=True, timeout=30)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return {"commit": commit, "dirty": bool(status) if commit else None}


def run_record() -> dict:
    """How a result was made: the command, the code's revision, when, and how loaded the
    machine was as it was written (1/5/15-minute load averages)."""
    return {
        "command": command(),
        "git": git_revision(),
        "written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def write_json(path: Path, data: dict) -> Path:
    """`data` at `path` with how it was made (run_record) and the machine it ran on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"run": run_record(), "machine": machine(), **data}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def write_result(name: str, data: dict) -> Path:
    """benchmarks/results/`name`.json (see write_json)."""
    return write_json(RESULTS / f"{name}.json", data)


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

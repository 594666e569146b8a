"""Before a GPU check spends device time: the versions this machine runs with, then every
module the GPU check touches imported (the project's packages whole, and the benchmarks
gpu_check.py runs), FlashInfer's wrappers checked against the backend's calls, and pulp's
CBC run on a tiny problem. Exit 1 if anything required fails, else 0; a GPU is not needed.

    python -m benchmarks.device.preflight [--require flashinfer --require pulp ...]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import platform
import shutil
import subprocess
import sys
import time
import traceback

PACKAGES = ("vlmserve", "kernels", "encoders", "scheduler", "search")
# gpu_check.py's parts and what they import inside functions.
GPU_CHECK_MODULES = (
    "benchmarks.gpu_check", "benchmarks.engine.offline_throughput", "benchmarks.ops.kernels",
    "benchmarks.engine.nanobatch", "benchmarks.ops.decode_bound",
    "vlmserve.worker.models.random_checkpoint", "vlmserve.worker.runner",
)  # fmt: skip
OPTIONAL = ("flashinfer", "pulp", "fastapi", "uvicorn", "tvm_ffi")


def version_of(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - a version line, not a failure
        return f"not importable ({type(e).__name__}: {e})"


def tool_version(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return "not on PATH"
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    return out.splitlines()[-1] if out else "?"


def print_versions() -> None:
    import torch

    cuda = torch.cuda.is_available()
    gpu = "no CUDA device visible"
    if cuda:
        major, minor = torch.cuda.get_device_capability(0)
        gpu = f"{torch.cuda.get_device_name(0)} (sm_{major}{minor})"
    rows = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__} (CUDA build {torch.version.cuda})",
        "gpu": gpu,
        **{m: version_of(m) for m in ("transformers", "triton", "timm", "numpy", *OPTIONAL)},
        "nvcc": tool_version(["nvcc", "--version"]),
        "ninja": tool_version(["ninja", "--version"]),
        "driver": tool_version(["nvidia-smi", "--query-gpu=driver_version", "--format=csv"]),
    }
    for name, value in rows.items():
        print(f"{name:<14} {value}")


def project_modules() -> list[str]:
    """Every module of the project's packages (a package's `__main__` runs, so not that)."""
    names = []
    for package in PACKAGES:
        names.append(package)
        path = importlib.import_module(package).__path__
        for info in pkgutil.walk_packages(path, prefix=package + "."):
            if not info.name.endswith(".__main__"):
                names.append(info.name)
    return names


def import_all(names: list[str]) -> list[str]:
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - name each one that fails, go on
            failed.append(name)
            print(f"IMPORT FAILED: {name}\n{traceback.format_exc(limit=3)}")
    return failed


def check_flashinfer() -> str | None:
    import flashinfer

    from kernels.flashinfer_attention import api_mismatch

    return api_mismatch(flashinfer)


def check_pulp() -> str | None:
    """CBC (the binary pulp ships) solves a 2-variable integer problem: it runs here."""
    import pulp

    prob = pulp.LpProblem("preflight", pulp.LpMaximize)
    x, y = pulp.LpVariable("x", 0, 3, cat="Integer"), pulp.LpVariable("y", 0, 3, cat="Integer")
    prob += x + 2 * y
    prob += x + y <= 4
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=10))
    got = (pulp.value(x), pulp.value(y))
    return None if got == (1, 3) else f"CBC answered {got}, not (1, 3)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--require", action="append", default=[], choices=OPTIONAL,
                   help="fail if this optional library does not import")  # fmt: skip
    args = p.parse_args(argv)
    start = time.perf_counter()
    print_versions()
    names = list(dict.fromkeys([*GPU_CHECK_MODULES, *project_modules()]))
    failed = import_all(names)
    for name in args.require:
        if importlib.util.find_spec(name) is None:
            failed.append(name)
            print(f"REQUIRED BUT MISSING: {name}")
    for name, check in (("flashinfer", check_flashinfer), ("pulp", check_pulp)):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            problem = check()
        except Exception as e:  # noqa: BLE001 - report it as the check's answer
            problem = f"{type(e).__name__}: {e}"
        print(f"{name} check    {problem or 'ok'}")
        if problem:
            failed.append(f"{name} check")
    listed = f": {', '.join(failed)}" if failed else ""
    seconds = time.perf_counter() - start
    print(
        f"preflight: {len(names)} modules imported, {len(failed)} failed{listed} ({seconds:.0f}s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

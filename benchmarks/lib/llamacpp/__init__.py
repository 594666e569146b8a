"""llama.cpp as a benchmark peer (issue 39): `llama-cpp-python` (llama.cpp built from
source, with its OpenAI-compatible server) in its own virtual environment, outside the
project's `.venv`, built on first use.

Facts the build rests on:
- `-DGGML_NATIVE=ON` built a library that crashed at model load on an AMX Xeon; a generic
  build with the instruction sets named (`-DGGML_NATIVE=OFF -DGGML_AVX2=ON
  -DGGML_AVX512=ON`) ran. So the build names the sets this CPU lists in /proc/cpuinfo
  (`cmake_args`), and the environment is keyed by them: a machine with other flags
  builds its own (`venv_dir`).
- The build compiles llama.cpp with CMake: several minutes on 2 cores.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from kernels.cpu_build import cpu_flags

LLAMA_CPP = "llama-cpp-python[server]==0.3.36"
DEFAULT_ROOT = Path.home() / ".cache" / "vlmserve"
STAMP_NAME = ".vlmserve-llamacpp"
# /proc/cpuinfo flag -> the ggml CMake option that compiles for it (AMX is left out: the
# generic build is what ran on the AMX Xeon).
GGML_SETS = (
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),  # /proc/cpuinfo spells it so
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
    ("avx_vnni", "GGML_AVX_VNNI"),
)


def cmake_args(flags: frozenset[str] | None = None) -> str:
    """CMAKE_ARGS for a generic build with the instruction sets this CPU has."""
    flags = cpu_flags() if flags is None else flags
    sets = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in GGML_SETS]
    return " ".join(["-DGGML_NATIVE=OFF", *sets])


def venv_dir(root: Path = DEFAULT_ROOT) -> Path:
    key = hashlib.sha256(f"{LLAMA_CPP} {cmake_args()}".encode()).hexdigest()[:10]
    return root / f"llamacpp-venv-{key}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path | None = None) -> Path:
    """The llama.cpp environment's interpreter, building it first unless its stamp says it
    is complete (an interrupted build is redone)."""
    venv = venv or venv_dir()
    stamp = venv / STAMP_NAME
    want = f"{LLAMA_CPP} {cmake_args()}"
    if stamp.is_file() and stamp.read_text().strip() == want:
        return venv_python(venv)
    print(f"[llamacpp] building llama.cpp in {venv} ({cmake_args()}; minutes)", flush=True)
    if not venv_python(venv).is_file():
        _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv_python(venv))
    env = {"CMAKE_ARGS": cmake_args(), "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    _run([py, "-m", "pip", "install", "-q", "--no-cache-dir", LLAMA_CPP], env)
    _run([py, "-c", "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)"])
    stamp.write_text(want + "\n")
    return venv_python(venv)


def _run(cmd: list[str], extra_env: dict[str, str] | None = None) -> None:
    import os

    print("[llamacpp] $ " + " ".join(cmd), flush=True)
    env = {**os.environ, **(extra_env or {})}
    subprocess.run(cmd, check=True, stdout=sys.stdout, stderr=sys.stderr, env=env)

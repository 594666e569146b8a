"""Building the C++ CPU kernels (kernels/csrc/*.cpp) with torch.utils.cpp_extension.

Each source is compiled the first time a process needs it (about 20 s) into a build
directory named for the source's content (and the shared headers'), the flags, the
torch build and the CPU it compiles for (-march=native), so checkouts
of the same code share one build, a changed kernel never reuses a stale one, and two
checkouts of different code never rebuild over each other in turn (torch's default keys
the directory by the extension's name alone and rebuilds whenever the source path changes).
The sources are compiled from copies inside that directory: ninja's build file names the
source path, so checkouts at different paths would otherwise still rebuild each other's
shared build (about a minute each time on a loaded machine).
Where no compiler is found the build fails once and the caller keeps its torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
# -ffp-contract=off: no fused multiply-adds the source does not write, so elementwise
# kernels round as the eager ops they replace do.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and instruction-set flags (a build
    for one CPU may not run on another sharing the cache, e.g. AVX-512 code on an AVX2-only
    machine)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU part")
    first = text.split("\n\n", 1)[0]  # one processor's entry
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in wanted)


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where it cannot be
    read: then no native bfloat16 is assumed). The one place the engine reads them."""
    for line in cpu_features().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16() -> str | None:
    """The CPU's native bfloat16 instructions ("amx_bf16", "avx512_bf16"): bfloat16 GEMMs
    run 2-3x float32 there (AMX further). None: none, bfloat16 is emulated (converted to
    float32 and back), slower than float32."""
    flags = cpu_flags()
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


def build_directory(name: str, source: Path) -> Path:
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(CSRC.glob("*.h")):  # what the sources include
        digest.update(header.read_bytes())
    digest.update(" ".join([*CFLAGS, torch.__version__]).encode())
    digest.update(cpu_features().encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(root) / "vlmserve" / f"{name}-{digest.hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    for file in [source, *CSRC.glob("*.h")]:
        copy = path / file.name
        if not copy.exists():  # never rewritten: a newer mtime would make ninja rebuild
            tmp = path / f".{file.name}.{os.getpid()}"
            tmp.write_bytes(file.read_bytes())
            os.replace(tmp, copy)
    return path


@functools.cache
def load(name: str) -> str | None:
    """Compile and load kernels/csrc/`name`.cpp (it registers its torch.ops on load).
    None when it loaded, else why it did not."""
    source = CSRC / f"{name}.cpp"
    try:
        from torch.utils.cpp_extension import load as cpp_load

        directory = build_directory(name, source)
        cpp_load(
            name=f"vlmserve_{name}",
            sources=[str(directory / source.name)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )
        return None
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: fall back, say why
        log.warning("C++ kernel %s unavailable, using the torch path: %s", name, e)
        return f"{type(e).__name__}: {e}"

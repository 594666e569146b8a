"""Building the C++ CPU kernels (kernels/csrc/*.cpp) with torch.utils.cpp_extension.

`./dev`'s set-up and `vlmserve info --build-kernels` build them all ahead (`build_all`);
otherwise each is compiled the first time a process needs it (about 20 s). A build
directory is named for everything that enters the build file torch writes there: the
source's content and the shared headers', the compiler and its version, the flags, the
include and library paths (torch's and Python's), the torch build and the CPU it compiles
for (-march=native). So checkouts of the same code in one environment share one build, a
changed kernel never reuses a stale one, and two checkouts of different code, or two
environments with the same torch at different paths (a second virtualenv, one reached
through a symlink), never rewrite each other's build file and rebuild in turn (torch's
default keys the directory by the extension's name alone). The sources are compiled from
copies inside that directory, since ninja's build file names the source path.
Where no compiler is found the build fails once and the caller keeps its torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import multiprocessing
import os
import platform
import shutil
import subprocess
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from kernels import ISA_TARGETS, isa_target

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
# -ffp-contract=off: no fused multiply-adds the source does not write, so elementwise
# kernels round as the eager ops they replace do.
# Tuples, passed to torch as fresh lists: torch appends its library flags to the list it is
# given, which would change the next kernel's key in the same process.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)


def cflags() -> tuple[str, ...]:
    """CFLAGS, for the instruction-set target where VLMSERVE_ISA names one (kernels/)."""
    target = isa_target()
    if target is None:
        return CFLAGS
    return tuple(f"-march={ISA_TARGETS[target]['march']}" if f == "-march=native" else f
                 for f in CFLAGS)  # fmt: skip


@functools.cache
def cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and instruction-set flags (a build
    for one CPU may not run on another sharing the cache, e.g. AVX-512 code on an AVX2-only
    machine). Under VLMSERVE_ISA, the flags that target has."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU part")
    first = text.split("\n\n", 1)[0]  # one processor's entry
    lines = [line for line in first.splitlines() if line.split(":")[0].strip() in wanted]
    target = isa_target()
    if target is None:
        return "\n".join(lines)
    lacks = ISA_TARGETS[target]["lacks"]  # the flags as the target CPU would list them
    for i, line in enumerate(lines):
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            kept = [flag for flag in value.split() if not flag.startswith(lacks)]
            lines[i] = f"{key}: {' '.join(kept)}"
    return "\n".join(lines)


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


@functools.cache
def compiler_version(cxx: str) -> str:
    """`cxx --version`'s first line ("" where it does not run): another compiler at the
    same path (an upgrade) compiles differently."""
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.partition("\n")[0]


def build_inputs() -> list[str]:
    """Everything but the sources that torch writes into a kernel's build file, as that
    file spells it (paths unresolved: a path through a symlink is another build file)."""
    from torch.utils import cpp_extension

    cxx = cpp_extension.get_cxx_compiler()
    return [
        f"cxx={cxx}",
        f"cxx_path={shutil.which(cxx) or ''}",
        f"cxx_version={compiler_version(cxx)}",
        f"cflags={' '.join(cflags())}",
        f"ldflags={' '.join(LDFLAGS)}",
        f"torch={torch.__version__} {torch.version.git_version}",
        *(f"include={path}" for path in cpp_extension.include_paths("cpu")),
        f"include={sysconfig.get_path('include', scheme='posix_prefix')}",
        *(f"lib={path}" for path in cpp_extension.library_paths("cpu")),
        f"cpu={cpu_features()}",
    ]


@functools.cache
def sources_digest() -> str:
    """A digest of every kernel source and header here: a calibration measured with other
    kernels (kernels/calibration.py) is measured again."""
    digest = hashlib.sha256()
    for path in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def build_key(source: Path) -> str:
    """The build directory's key: the source, the headers it may include, build_inputs()."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.name.encode() + header.read_bytes())
    digest.update("\n".join(build_inputs()).encode())
    return digest.hexdigest()[:12]


def build_directory(name: str, source: Path) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(root) / "vlmserve" / f"{name}-{build_key(source)}"
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
            extra_cflags=list(cflags()),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            is_python_module=False,
        )
        return None
    except Exception as e:  # noqa: BLE001 - no compiler, no headers: fall back, say why
        log.warning("C++ kernel %s unavailable, using the torch path: %s", name, e)
        return f"{type(e).__name__}: {e}"


KERNELS = tuple(sorted(path.stem for path in CSRC.glob("*.cpp")))


def _compile(name: str) -> tuple[str | None, float]:
    """In a process of its own (build_all): compile and load one kernel, and the seconds."""
    start = time.perf_counter()
    why = load(name)
    return why, round(time.perf_counter() - start, 1)


def build_all() -> dict[str, dict[str, object]]:
    """Build (or find built) every kernel: per kernel whether it was already built, the
    seconds it took, and why it is unavailable (None when it loaded). The missing ones are
    compiled side by side, a process each, as many at once as there are cores (a compile
    is one process on one core: on a fresh 16-core machine, one after another took minutes),
    then loaded here."""
    built = {n: any(build_directory(n, CSRC / f"{n}.cpp").glob("*.so")) for n in KERNELS}
    missing = [name for name in KERNELS if not built[name]]
    compiled = {}
    if missing:
        context = multiprocessing.get_context("spawn")  # no forked torch threads
        workers = min(len(missing), os.cpu_count() or 1)
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            compiled = dict(zip(missing, pool.map(_compile, missing), strict=True))
    report = {}
    for name in KERNELS:
        start = time.perf_counter()
        failed, seconds = compiled.get(name, (None, None))
        why = failed or load(name)  # one its own process could not build is not tried again
        if seconds is None:
            seconds = round(time.perf_counter() - start, 1)
        report[name] = {"already_built": built[name], "seconds": seconds, "error": why}
    return report

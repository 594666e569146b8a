"""The kernels, and the instruction sets they may use (torch-free: imported before torch).

`VLMSERVE_ISA=avx2` runs a process as on a CPU with AVX2 and FMA but nothing newer (an
EPYC before Zen 4, x86-64-v3), on whatever CPU it is: our C++ kernels are compiled with
`-march=x86-64-v3` instead of `-march=native`, the flags the engine reads drop AVX-512,
AVX-VNNI and AMX (so no native bfloat16: the auto dtype is float32), and torch's own
kernels, oneDNN and MKL are capped at AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS, unless already set). The calibration and the kernel builds are
keyed by those flags, so such a process never mixes its choices or builds with native ones.
It checks and times the AVX2 paths on a machine that has more; the memory system and
clocks stay this CPU's, so a figure so taken is "AVX2 code on this CPU", not an AVX2 CPU's.
"""

import os

ISA_ENV = "VLMSERVE_ISA"
# Per target: the -march it compiles for, the /proc/cpuinfo flag prefixes it lacks, and
# what torch's libraries read to cap themselves there.
ISA_TARGETS = {
    "avx2": {
        "march": "x86-64-v3",
        "lacks": ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert"),
        "env": {
            "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        },
    },
}


def isa_target() -> str | None:
    """The instruction-set target VLMSERVE_ISA names (None: "native" or unset, all this CPU
    has); an unknown name is an error, never silently native."""
    name = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if name == "native":
        return None
    if name not in ISA_TARGETS:
        raise ValueError(f"{ISA_ENV}={name!r}: use one of native, {', '.join(ISA_TARGETS)}")
    return name


def cap_libraries() -> None:
    """Put the target's caps for torch's libraries in os.environ (a variable already set
    wins); each library reads its own when first used, so this runs before any op. An
    unknown target caps nothing here: it is refused where it is read (`vlmserve` says so
    before any command; kernels/cpu_build.py raises)."""
    try:
        target = isa_target()
    except ValueError:
        return
    for key, value in (ISA_TARGETS[target]["env"] if target else {}).items():
        os.environ.setdefault(key, value)


cap_libraries()

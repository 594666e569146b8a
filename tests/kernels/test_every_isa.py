"""Every C++ kernel compiles for every kind of x86 CPU the project runs on, not only the
one this machine is: each is built with -march=native where it runs, so code guarded by
one instruction set (AMX, AVX-512 BF16) must leave the others whole. A front-end pass
(`-fsyntax-only`) per source and target, without building anything."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from kernels import cpu_build

# The three kinds of machine this project gets: AVX2 only (an EPYC before Zen 4), AVX-512
# BF16 without AMX (a Zen 4 or 5's set), AVX-512 BF16 with AMX (a Sapphire Rapids Xeon).
# About 6 s a compile (torch's headers), 18 in all.
TARGETS = {
    "avx2": ["-march=x86-64-v3"],
    "avx512-bf16": ["-march=icelake-server", "-mavx512bf16"],
    "amx": ["-march=sapphirerapids"],
}


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", cpu_build.KERNELS)
def test_the_kernel_compiles_for_each_instruction_set(kernel, target):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler here")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{cpu_build.CSRC}"]
    cmd = [compiler, "-std=c++20", "-fsyntax-only", "-fopenmp", *TARGETS[target], *includes,
           str(cpu_build.CSRC / f"{kernel}.cpp")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{kernel} for {target}:\n{done.stderr[-3000:]}"

"""VLMSERVE_ISA: a process run as on an AVX2-only CPU (x86-64-v3) on whatever CPU this is,
and what such a CPU lacks: oneDNN takes no bfloat16 there, so bfloat16 layers stay plain
instead of failing at load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from kernels import cpu_build
from vlmserve.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
CPUINFO = Path("/proc/cpuinfo")
HAS_AVX2 = CPUINFO.exists() and "avx2" in CPUINFO.read_text()


@pytest.fixture
def avx2(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    cpu_build.cpu_features.cache_clear()
    yield
    cpu_build.cpu_features.cache_clear()


def test_the_avx2_target_compiles_for_x86_64_v3_and_reads_its_flags(avx2):
    assert "-march=x86-64-v3" in cpu_build.cflags() and "-march=native" not in cpu_build.cflags()
    flags = cpu_build.cpu_flags()
    assert not any(f.startswith(("avx512", "amx", "avx_vnni")) for f in flags)
    if HAS_AVX2:
        assert {"avx2", "fma"} <= flags
    assert cpu_build.native_bf16() is None  # so the auto dtype is float32


def test_native_is_the_default_and_an_unknown_target_is_refused(monkeypatch, capsys):
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    assert kernels.isa_target() is None and cpu_build.cflags() == cpu_build.CFLAGS
    monkeypatch.setenv(kernels.ISA_ENV, "avx-512")
    with pytest.raises(ValueError, match="native, avx2"):
        kernels.isa_target()
    kernels.cap_libraries()  # at import: caps nothing, raises nothing
    # the command line refuses it before any work (estimate reads no CPU flags): a message
    assert main(["estimate", "kv"]) == 2
    assert "VLMSERVE_ISA='avx-512': use one of native, avx2" in capsys.readouterr().err


def test_the_libraries_are_capped_unless_set(avx2, monkeypatch):
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(key, raising=False)
    kernels.cap_libraries()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"  # the user's own wins


# In a fresh process (the caps must be in place before torch's libraries first run): torch
# runs its AVX2 kernels and oneDNN refuses bfloat16, as on an AVX2 EPYC. A bfloat16 layer
# then keeps its plain weight and multiplies in float32 on it widened (before: PackedLinear
# raised at load; torch's own bfloat16 GEMM runs 4-400x slower there), as does the LM head
# above the skinny kernel's rows, and the speculation ridge times the GEMM the layers run,
# in float32 (before: a bfloat16 a @ b of 2,048, 42 s a call). Float32 layers are packed.
# Slow: a fresh machine compiles the skinny kernel for x86-64-v3 first (about 10 s).
SCRIPT = """
import pathlib, tempfile, torch, vlmserve
import torch.nn.functional as F
from torch import nn
from kernels import calibration, lm_head, packed_linear
from vlmserve.sample import verify
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
assert not packed_linear.packable(torch.bfloat16) and packed_linear.packable(torch.float32)
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32)).to(dtype)
    x = torch.randn(300, 64).to(dtype)
    wide = [(m.weight.double(), m.bias.double()) for m in model]
    want = (x.double() @ wide[0][0].T + wide[0][1]).to(dtype).double() @ wide[1][0].T + wide[1][1]
    assert packed_linear.pack_linears(model) == 2, dtype
    assert (model[0].weight is None) == (dtype == torch.bfloat16)
    torch.testing.assert_close(model(x), want.to(dtype))  # within a rounding of `dtype`
embedding = torch.randn(500, 64).to(torch.bfloat16)
calibration.CACHE_DIR = pathlib.Path(tempfile.mkdtemp())  # a fresh calibration
head = lm_head.logits_head(None, embedding)
assert head.packed is None and head.choice.gemm == "plain", head.choice
x = torch.randn(300, 64).to(torch.bfloat16)
want = x.double() @ embedding.double().T
assert ((head(x).double() - want).abs() <= 2**-8 * want.abs() + 1e-4).all()
linear, seen = F.linear, []
F.linear = lambda x, w, b=None: seen.append((x.dtype, w.dtype)) or linear(x, w, b)
verify.measure_cpu_ridge(torch.bfloat16)
assert seen and set(seen) == {(torch.float32, torch.float32)}, seen
print("ok")
"""


@pytest.mark.slow
def test_an_avx2_process_runs_bfloat16_layers_widened():
    if not HAS_AVX2:
        pytest.skip("not an x86 CPU with AVX2")
    env = {**os.environ, kernels.ISA_ENV: "avx2", "PYTHONPATH": str(ROOT)}
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

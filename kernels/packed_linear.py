"""Prepacked oneDNN linear layers for CPU float32 and bfloat16, and linear + epilogue helpers.

`PackedLinear` holds its weight reordered once into oneDNN's blocked layout, as vLLM's
CPU build does. `linear_act` / `linear_add` run a linear layer with its activation or its
residual add fused into the GEMM's epilogue when the layer is packed (oneDNN post-ops: the
[rows, out] result is written once instead of being read back by a separate elementwise
pass), and as the plain ops otherwise (GPU, float16, torch without oneDNN). The decoder and
the SigLIP tower both use them, in float32 (same oneDNN/MKL arithmetic as the plain
layers, only the summation order differs) or in bfloat16 (oneDNN's bfloat16 GEMM with
float32 accumulation: AVX-512 BF16 dot products or AMX tiles where the CPU has them),
checked against the plain layers in tests.

The decoder's layers can also keep the plain [out, in] weight (`pack_linears(plain=True)`,
a second copy of each weight) for the batch sizes oneDNN's packed GEMM is not the fastest
at on a CPU, each crossover measured on the CPU that runs it (kernels/calibration.py;
`benchmarks/ops/calibration.py` prints the tables):
- up to `skinny_max_rows` rows (decode steps of a few sequences; per dtype and layer
  shape) the skinny kernel (kernels/csrc/skinny_linear_cpu.cpp), which streams each
  weight once;
- float32 only, from `mkl_min_rows()` rows (large prefill chunks) MKL on the plain weight,
  where MKL beats oneDNN on this CPU (on a Zen 3 from ~1,536 rows, on a Zen 5 with AVX-512
  never). Between the two, oneDNN's packed GEMM.

The LM head's paths (kernels/lm_head.py) use the same kernels: the skinny one with
float32 sums out, oneDNN's packed GEMM, and on AMX CPUs a tile kernel of our own on its own
packed copy of the weight (`amx_linear`, and `amx_argmax` for greedy tokens).
"""

from __future__ import annotations

import functools
import time
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kernels import calibration, cpu_build

__all__ = [
    "Activation", "PackedLinear", "amx_argmax", "amx_linear", "linear_act", "linear_add",
    "pack_linears", "skinny_linear",
]  # fmt: skip

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The sizes each choice is measured at (kernels/calibration.py). The decoder's linears:
# decode steps' rows, per dtype and layer shape (the skinny kernel up to somewhere in 1-64
# rows on the CPUs measured so far: 16 in float32, 8 in bfloat16 on a Zen 5).
LINEAR_LADDER = (1, 2, 4, 8, 16, 32, 64)
# A weight is measured on at most this many bytes of its output rows: the per-row cost of
# a weight streamed from memory, in a bounded time (a 262k-token head is 335 MB).
LINEAR_MAX_BYTES = 16 << 20
# A ladder stops after this long (a loaded machine), decided on the sizes measured (the LM
# head's, kernels/lm_head.py, gets longer).
LADDER_BUDGET_S = 1.5
# float32 prefill GEMMs: MKL on the plain weight against oneDNN's packed GEMM, one square
# GEMM at 2,048 and 1,024 rows (MKL won from ~1,536 rows on a Zen 3 and never on a Zen 5,
# where it runs its AVX2 code: benchmarks/ops/gemm_crossover.py).
MKL_DIM = 1024
MKL_ROWS = (2048, 1024)  # measured largest first: a loss at 2,048 ends it
# The shape `plain_rows` reports without one (`vlmserve info` without a model).
REPRESENTATIVE_SHAPE = (1024, 1024)


def plain_rows(dtype: torch.dtype, shape: tuple[int, int] | None = None) -> tuple[int, int | None]:
    """(the most rows the skinny kernel takes, the fewest a plain-weight GEMM takes, None:
    never) for a layer of `shape` (in, out) holding its plain weight in `dtype`, as
    calibrated on this CPU (float32 only: MKL on the plain weight; in bfloat16 torch's
    F.linear is oneDNN on an unpacked weight, never ahead of the packed one)."""
    in_features, out_features = shape or REPRESENTATIVE_SHAPE
    skinny = skinny_max_rows(dtype, in_features, out_features)
    return skinny, mkl_min_rows() if dtype == torch.float32 else None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measured_rows(out_features: int, in_features: int, dtype: torch.dtype, cap: int) -> int:
    return max(1, min(out_features, cap // (in_features * dtype.itemsize)))


def skinny_max_rows(dtype: torch.dtype, in_features: int, out_features: int) -> int:
    """The most rows the skinny kernel takes for an [out, in] weight in `dtype` (oneDNN's
    packed GEMM above, or `plain_gemm` where oneDNN takes no `dtype`), calibrated on this
    CPU at that shape (0 where it cannot run)."""
    if skinny_available() is not None:
        return 0
    out_m = measured_rows(out_features, in_features, dtype, LINEAR_MAX_BYTES)
    name = f"linear_skinny_max_rows/{dtype_name(dtype)}/{in_features}x{out_m}"
    gemm = "onednn" if packable(dtype) else "plain"  # the GEMM this dtype gets above it
    return calibration.calibrated(
        name,
        lambda: measure_ladder(dtype, in_features, out_m, LINEAR_LADDER, ("skinny", gemm)),
        lambda m: calibration.decide_max_rows(m, "skinny", gemm),
    )


@functools.cache
def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies a weight in `dtype` on this CPU: float32 where
    torch has oneDNN; bfloat16 only where the CPU has AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
    (torch refuses it on an AVX2-only CPU: see `plain_gemm`)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def plain_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear on the plain weight; in bfloat16 on a CPU whose oneDNN takes none (an
    AVX2-only CPU), the float32 GEMM of x and the weight widened for the call, rounded back
    once: torch's own bfloat16 GEMM there runs 4x slower (F.linear at 256-1,024 rows) to
    400x (a square a @ b) on an AMD EPYC under VLMSERVE_ISA=avx2."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or packable(torch.bfloat16):
        return F.linear(x, weight, bias)
    wide_bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)


def mkl_min_rows() -> int | None:
    """The fewest rows a float32 layer with its plain weight sends to MKL on this CPU
    (None: never), calibrated once per CPU."""
    return calibration.calibrated(
        f"mkl_min_rows/float32/{MKL_DIM}x{MKL_DIM}", _measure_mkl, calibration.decide_mkl
    )


def measure_ladder(
    dtype: torch.dtype, in_features: int, out_features: int, ladder: tuple[int, ...],
    paths: tuple[str, ...], budget_s: float = LADDER_BUDGET_S, logits: bool = False,
) -> calibration.Measured:  # fmt: skip
    """Seconds per call of `paths` (of "skinny", "onednn" / "packed", "plain") for an
    [out, in] weight in `dtype` at each row count of `ladder`, interleaved; stops after the
    skinny kernel lost by MARGIN at two sizes in a row (larger sizes only widen the gap), or
    after `budget_s`. The LM head's ladder (`logits`: float32 out) goes on past the skinny
    kernel's losses: its packed-or-plain choice is by rows, up to the largest."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    onednn = "onednn" in paths or "packed" in paths
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn else None
    amx = torch.ops.vlmserve_skinny.amx_pack(weight) if "amx" in paths else None
    out_dtype = torch.float32 if logits else None
    measured, losses, start = [], 0, time.perf_counter()
    for rows in ladder:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        run = {
            "skinny": lambda x=x: skinny_linear(x, weight, None, out_dtype),
            "onednn": lambda x=x: _onednn(x, packed),
            "packed": lambda x=x: _onednn(x, packed).float(),
            "plain": lambda x=x: plain_gemm(x, weight).to(out_dtype or dtype),
            "amx": lambda x=x: amx_linear(x, amx),
        }
        seconds = calibration.time_paths({p: run[p] for p in paths})
        measured.append({"rows": rows, **seconds})
        best_gemm = min(seconds[p] for p in paths if p != "skinny")
        losses = losses + 1 if seconds["skinny"] > calibration.MARGIN * best_gemm else 0
        if (losses == 2 and not logits) or time.perf_counter() - start > budget_s:
            break
    return measured


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _measure_mkl() -> calibration.Measured:
    """Seconds of an MKL_DIM-square float32 GEMM through oneDNN packed and MKL plain at
    MKL_ROWS, interleaved; stops after the first size where oneDNN wins."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(MKL_DIM, MKL_DIM, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    measured = []
    for rows in MKL_ROWS:
        x = torch.randn(rows, MKL_DIM, generator=gen)
        seconds = calibration.time_paths({
            "onednn": lambda x=x: _onednn(x, packed),
            "mkl": lambda x=x: F.linear(x, weight),
        })  # fmt: skip
        measured.append({"rows": rows, **seconds})
        if seconds["onednn"] < calibration.MARGIN * seconds["mkl"]:  # MKL lost: done
            break
    return measured


# The activations a packed layer can fuse: exact GELU (erf) and the tanh approximation.
Activation = Literal["gelu", "gelu_tanh"]
# Activation -> (F.gelu's `approximate`, oneDNN's gelu algorithm)
_GELU = {"gelu": ("none", "none"), "gelu_tanh": ("tanh", "tanh")}


class PackedLinear(nn.Module):
    """A CPU float32 or bfloat16 `nn.Linear` whose weight is reordered once into oneDNN's
    blocked layout: at decode-sized batches (tens of rows) the GEMM runs about 20% faster
    than MKL on the plain weight, and the same at prefill sizes. Float32: the same results
    as the plain layer (float32 GEMM either way, checked in tests); bfloat16: float32
    accumulation, the output rounded once. Inputs may have any leading dims. Where oneDNN
    takes no bfloat16 (an AVX2-only CPU: `packable`) a bfloat16 layer keeps its plain weight
    only (`weight` None) and multiplies by `plain_gemm` above the skinny kernel's rows."""

    def __init__(self, linear: nn.Linear, plain: bool = False) -> None:
        """`plain`: keep the plain weight too, for the skinny kernel and MKL (see the module
        doc), where the skinny kernel builds and runs on this CPU."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        packs = packable(weight.dtype)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if packs else None
        self.bias = None if linear.bias is None else linear.bias.detach()
        keep = plain and skinny_available() is None
        self.plain = weight.contiguous() if keep or not packs else None
        # Calibrated only where a plain weight is kept (the tower's layers never ask), at
        # construction: the step never measures.
        shape = (self.in_features, self.out_features)
        self.skinny_rows, self.plain_rows = plain_rows(weight.dtype, shape) if keep else (0, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            rows = x.numel() // self.in_features
            if rows <= self.skinny_rows:
                return skinny_linear(x, self.plain, self.bias)
            if self.plain_rows is not None and rows >= self.plain_rows:
                return F.linear(x, self.plain, self.bias)
        return self.forward_packed(x)

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b on oneDNN's packed weight (`plain_gemm` where none), whatever the rows."""
        if self.weight is None:
            return plain_gemm(x, self.plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def forward_act(self, x: torch.Tensor, act: Activation) -> torch.Tensor:
        """act(x @ W.T + b), the activation applied by the GEMM as it writes its output."""
        if self.weight is None:
            return F.gelu(self.forward_packed(x), approximate=_GELU[act][0])
        return torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, "gelu", [], _GELU[act][1]
        )

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b + residual (a post-op add: `residual` is read, not modified)."""
        if self.weight is None:
            return self.forward_packed(x).add_(residual)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")


def linear_act(layer: nn.Module, x: torch.Tensor, act: Activation) -> torch.Tensor:
    """act(layer(x)); fused into the GEMM when `layer` is a PackedLinear."""
    if isinstance(layer, PackedLinear):
        return layer.forward_act(x, act)
    return F.gelu(layer(x), approximate=_GELU[act][0])


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x); fused into the GEMM when `layer` is a PackedLinear, otherwise
    added in place into the fresh GEMM output (no third tensor)."""
    if isinstance(layer, PackedLinear):
        return layer.forward_add(x, residual)
    return layer(x).add_(residual)


def skinny_available() -> str | None:
    """None when the skinny kernel is built, loaded and can run on this CPU (AVX-512 or
    AVX2 + FMA); otherwise why not."""
    why = cpu_build.load("skinny_linear_cpu")
    if why is None and torch.ops.vlmserve_skinny.vector_lanes() == 0:
        return "this CPU has neither AVX-512 nor AVX2 + FMA"
    return why


def amx_head_available(dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """Whether `amx_linear` takes a [out, in] weight in `dtype` here: bfloat16, in a
    multiple of 32, out of 16, on a CPU with AMX tiles (`amx_bf16`)."""
    return (
        dtype == torch.bfloat16 and in_features % 32 == 0 and out_features % 16 == 0
        and skinny_available() is None and torch.ops.vlmserve_skinny.amx_available()
    )  # fmt: skip


def amx_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """float32 x @ W.T on AMX tiles, bfloat16 x and W as `amx_pack` laid it out (W's
    [out / 16, in / 32, 16, 32] tiles): the float32 sums, as the skinny kernel's."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], packed.shape[0] * 16, dtype=torch.float32)
    torch.ops.vlmserve_skinny.amx_linear(out, rows, packed)
    return out.view(*x.shape[:-1], out.shape[1])


def amx_argmax(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """[rows] long: torch.argmax of `amx_linear(x, packed)` over its last dim (the first
    maximum, a NaN above every number), the float32 sums never written anywhere."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long)
    torch.ops.vlmserve_skinny.amx_argmax(out, rows, packed)
    return out.view(x.shape[:-1])


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias with the skinny kernel (CPU float32 or bfloat16, all of one
    dtype, `weight` contiguous [out, in]): for a few rows. Inputs may have any leading
    dims. `out_dtype`: x's (default), or float32 for bfloat16 x (the sums not rounded)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=out_dtype or x.dtype)
    torch.ops.vlmserve_skinny.linear(out, rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def pack_linears(module: nn.Module, plain: bool = False) -> int:
    """Replace every float32 or bfloat16 CPU `nn.Linear` under `module` with a `PackedLinear`
    (where torch has oneDNN); returns how many. `plain`: each keeps its plain weight too (a
    second copy, see the module doc); otherwise the plain weights are dropped."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for name, child in list(module.named_children()):
        if (
            isinstance(child, nn.Linear)
            and child.weight.device.type == "cpu"
            and child.weight.dtype in PACKED_DTYPES
        ):
            setattr(module, name, PackedLinear(child, plain))
            count += 1
        else:
            count += pack_linears(child, plain)
    return count

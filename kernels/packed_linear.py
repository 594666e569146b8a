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
at on a CPU (`benchmarks/ops/skinny_linear.py` measures the crossovers; its results file has
the figures):
- up to SKINNY_MAX_ROWS rows (decode steps of a few sequences) the skinny kernel
  (kernels/csrc/skinny_linear_cpu.cpp), which streams each weight once;
- float32 only, from `mkl_min_rows()` rows (large prefill chunks) MKL on the plain weight,
  where MKL beats oneDNN on this CPU (kernels/gemm_choice.py measures it once per CPU:
  on a Zen 3 from ~1,536 rows, on a Zen 5 with AVX-512 never). Between the two, oneDNN's
  packed GEMM is the fastest.

The LM head (`linear_float`) writes float32 logits straight from its float32 sums in
bfloat16 too (the skinny kernel's float32 output, up to LOGITS_SKINNY_MAX_ROWS rows),
instead of rounding them to bfloat16 and widening them back: sampling and logprobs read
float32 logits.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_build, gemm_choice

__all__ = [
    "Activation", "PackedLinear", "linear_act", "linear_add", "linear_float", "pack_linears",
    "skinny_linear",
]  # fmt: skip

SKINNY_MAX_ROWS = 16
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# bfloat16: the skinny kernel up to this many rows (on a Zen 5 with AVX-512 BF16, single
# thread: 1.1x oneDNN's packed bfloat16 GEMM at 1 row, even at 4, 0.8x at 16); no
# plain-weight GEMM at prefill sizes (torch's bfloat16 F.linear is oneDNN too, on an
# unpacked weight: no faster than the packed one at 512-2,048 rows;
# benchmarks/engine/bf16_speedup.py, measured under heavy load).
BF16_SKINNY_MAX_ROWS = 8
# The bfloat16 LM head with float32 logits out: the skinny kernel up to this many rows
# (a decode step's sampling rows), oneDNN's bfloat16 GEMM widened to float32 above
# (benchmarks/ops/bf16_profile.py measures both).
LOGITS_SKINNY_MAX_ROWS = 256


def plain_rows(dtype: torch.dtype) -> tuple[int, int | None]:
    """(the most rows the skinny kernel takes, the fewest a plain-weight GEMM takes, None:
    never) for a layer holding its plain weight in `dtype` (float32: calibrated once per
    CPU, kernels/gemm_choice.py)."""
    if dtype == torch.bfloat16:
        return BF16_SKINNY_MAX_ROWS, None
    return SKINNY_MAX_ROWS, gemm_choice.mkl_min_rows()


# The activations a packed layer can fuse: exact GELU (erf) and the tanh approximation.
Activation = Literal["gelu", "gelu_tanh"]
# Activation -> (F.gelu's `approximate`, oneDNN's gelu algorithm)
_GELU = {"gelu": ("none", "none"), "gelu_tanh": ("tanh", "tanh")}


class PackedLinear(nn.Module):
    """A CPU float32 or bfloat16 `nn.Linear` whose weight is reordered once into oneDNN's
    blocked layout: at decode-sized batches (tens of rows) the GEMM runs about 20% faster
    than MKL on the plain weight, and the same at prefill sizes. Float32: the same results
    as the plain layer (float32 GEMM either way, checked in tests); bfloat16: float32
    accumulation, the output rounded once. Inputs may have any leading dims."""

    def __init__(self, linear: nn.Linear, plain: bool = False) -> None:
        """`plain`: keep the plain weight too, for the skinny kernel and MKL (see the module
        doc), where the skinny kernel builds and runs on this CPU."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        keep = plain and skinny_available() is None
        self.plain = weight.contiguous() if keep else None
        # (calibrated only where a plain weight is kept: the tower's layers never ask)
        self.skinny_rows, self.plain_rows = plain_rows(weight.dtype) if keep else (0, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            rows = x.numel() // self.in_features
            if rows <= self.skinny_rows:
                return skinny_linear(x, self.plain, self.bias)
            if self.plain_rows is not None and rows >= self.plain_rows:
                return F.linear(x, self.plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def forward_act(self, x: torch.Tensor, act: Activation) -> torch.Tensor:
        """act(x @ W.T + b), the activation applied by the GEMM as it writes its output."""
        return torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, "gelu", [], _GELU[act][1]
        )

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x @ W.T + b + residual (a post-op add: `residual` is read, not modified)."""
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


def linear_float(layer: nn.Module | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head: `layer(x)` (or x @ weight.T where `layer` is None: tied embeddings) as
    float32. A bfloat16 CPU head writes its float32 sums as they are, through the skinny
    kernel, up to LOGITS_SKINNY_MAX_ROWS rows (a packed layer's plain weight, or the tied
    embedding itself: no copy); past that, or elsewhere, the layer's output widened."""
    plain = weight if layer is None else getattr(layer, "plain", None)
    if (
        x.dtype == torch.bfloat16
        and plain is not None
        and plain.device.type == "cpu"
        and x.numel() // x.shape[-1] <= LOGITS_SKINNY_MAX_ROWS
        and skinny_available() is None
    ):
        return skinny_linear(x, plain, getattr(layer, "bias", None), torch.float32)
    out = F.linear(x, weight) if layer is None else layer(x)
    return out.float()


def skinny_available() -> str | None:
    """None when the skinny kernel is built, loaded and can run on this CPU (AVX-512 or
    AVX2 + FMA); otherwise why not."""
    why = cpu_build.load("skinny_linear_cpu")
    if why is None and torch.ops.vlmserve_skinny.vector_lanes() == 0:
        return "this CPU has neither AVX-512 nor AVX2 + FMA"
    return why


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
    """Replace every float32 or bfloat16 CPU `nn.Linear` under `module` with a `PackedLinear` (where
    torch has oneDNN); returns how many. `plain`: each keeps its plain weight too (a
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

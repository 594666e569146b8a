"""Quantized linears for GPUs: GGUF blocks dequantized per tile inside a Triton GEMM, and
FP8 (e4m3) weights through torch's `_scaled_mm`.

GGUF (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K; the blocks of kernels/quant_linear.py's `QuantWeight`,
uint8 [out, bytes per row]): each program owns a [BLOCK_M, BLOCK_N] tile of the output and
walks K 32 weights at a time (one legacy block, or one K-quant sub-block: a step never
straddles a block), decoding its [BLOCK_N, 32] weights from the stored bytes in registers,
then one `tl.dot` into a float32 accumulator. No dequantized copy of W exists anywhere.
The decode repeats gguf.quants' float32 operations in their order (bit-identical in the
interpreter; a GPU may fuse a multiply-add). x in bfloat16 / float16 takes the weights
rounded to its dtype into the dot (as the CPU tile path does); float32 stays IEEE float32.
The same decode serves an embedding's looked-up rows (`dequantize_rows`).

FP8 weight-only: `quantize_fp8` stores W as e4m3fn with a float32 scale per output row
(or one per tensor). `Fp8Linear` runs `torch._scaled_mm` with each activation row scaled
to e4m3 as well (a scale per token) where the device has FP8 matmuls (CUDA sm_89+); else
it dequantizes W to x's dtype and calls F.linear (the CPU's path: FP8 is refused as an
engine option there, kernels/quant_linear.py's int8 is the CPU's format).

Verified in Triton's interpreter (TRITON_INTERPRET=1) and on the CPU's `_scaled_mm` until
a GPU run: tests/kernels/quant/test_quant_gpu.py (its `gpu` cases: benchmarks/gpu_check.py).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType
from torch import nn

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
# The block types the Triton decode knows (kernels/quant_linear.py's SUPPORTED_QTYPES).
TRITON_QTYPES = frozenset(int(t) for t in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K))
_Q4_0, _Q5_0, _Q8_0, _Q4_K, _Q6_K = (int(t) for t in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K))
# Bytes per block, the decode's strides (gguf's GGML_QUANT_SIZES).
_BLOCK_BYTES = {_Q8_0: 34, _Q4_0: 18, _Q5_0: 22, _Q4_K: 144, _Q6_K: 210}
FP8_MAX = 448.0  # e4m3fn's largest finite value
FP8 = torch.float8_e4m3fn
INTERPRETED = bool(triton.knobs.runtime.interpret)
# Triton before 3.7 interprets `range(0, K, 32)` with K a kernel argument as int() of a
# 1-element array, which numpy refuses; compiled kernels (CUDA) are not affected.
OLD_INTERPRETER = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)


def available(device: torch.device) -> str | None:
    """None when the Triton kernels run on `device`; otherwise why not."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and INTERPRETED and OLD_INTERPRETER:
        return (f"Triton {triton.__version__}'s interpreter cannot loop to a kernel argument "
                "(fixed in 3.7): on a CPU use triton >= 3.7")  # fmt: skip
    if device.type == "cpu" and INTERPRETED:
        return None
    return f"Triton kernels run on CUDA, or on a CPU under TRITON_INTERPRET=1 (not {device})"


@triton.jit
def _f16(ptr):
    """The little-endian float16 at the two bytes at `ptr` (any shape), as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _cast(v, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """v (float32) in `dtype`, rounded to nearest even. EMULATE (the interpreter, bfloat16):
    its cast truncates, so round the bits here first (then the cast is exact)."""
    if EMULATE:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _decode(w_ptr, row_base, k0, j, QTYPE: tl.constexpr, BYTES: tl.constexpr):
    """Weights k0 .. k0 + 31 of the rows at byte offsets `row_base` [R, 1], as float32
    [R, 32]; k0 a multiple of 32, j = arange(32)[None, :]. Layouts: gguf/quants.py."""
    if QTYPE == 8:  # Q8_0: d, then 32 int8
        base = w_ptr + row_base + (k0 // 32) * BYTES
        q = tl.load(base + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
        return q * _f16(base)
    elif QTYPE == 2:  # Q4_0: d, 16 bytes: weights 0-15 low nibbles, 16-31 high
        base = w_ptr + row_base + (k0 // 32) * BYTES
        q = (_byte(base + 2 + j % 16) >> ((j // 16) * 4)) & 15
        return _f16(base) * (q - 8).to(tl.float32)
    elif QTYPE == 6:  # Q5_0: d, 32 high bits (little-endian), then Q4_0's nibbles
        base = w_ptr + row_base + (k0 // 32) * BYTES
        high = (_byte(base + 2 + j // 8) >> (j % 8)) & 1
        q = ((_byte(base + 6 + j % 16) >> ((j // 16) * 4)) & 15) | (high << 4)
        return _f16(base) * (q - 16).to(tl.float32)
    elif QTYPE == 12:  # Q4_K: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        base = w_ptr + row_base + (k0 // 256) * BYTES
        s = (k0 % 256) // 32  # the sub-block, 0..7
        scales = base + 4
        if s < 4:
            sc = _byte(scales + s) & 63
            m = _byte(scales + s + 4) & 63
        else:
            sc = (_byte(scales + s + 4) & 15) | ((_byte(scales + s - 4) >> 6) << 4)
            m = (_byte(scales + s + 4) >> 4) | ((_byte(scales + s) >> 6) << 4)
        q = (_byte(base + 16 + (s // 2) * 32 + j) >> ((s % 2) * 4)) & 15
        d = _f16(base) * sc.to(tl.float32)
        dm = _f16(base + 2) * m.to(tl.float32)
        return d * q.to(tl.float32) - dm
    else:  # Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d
        base = w_ptr + row_base + (k0 // 256) * BYTES
        s = (k0 % 256) // 32
        h = s // 4
        g = s % 4
        low = (_byte(base + h * 64 + (g % 2) * 32 + j) >> ((g // 2) * 4)) & 15
        high = (_byte(base + 128 + h * 32 + j) >> (g * 2)) & 3
        scale = tl.load(base + 192 + s * 2 + j // 16).to(tl.int8, bitcast=True)
        d = _f16(base + 208) * scale.to(tl.float32)
        return d * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _gguf_matmul(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_w, stride_ym,
    QTYPE: tl.constexpr, BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr, EMULATE_OUT: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the edge read the last row (always in bounds) and are never stored.
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    row_base = (rows_n * stride_w)[:, None]  # [BLOCK_N, 1] byte offsets
    j = tl.arange(0, 32)[None, :]
    x_rows = x_ptr + rows_m[:, None] * stride_xm + j  # [BLOCK_M, 32]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 32):
        x = tl.load(x_rows + k0)  # [BLOCK_M, 32]
        w = _decode(w_ptr, row_base, k0, j, QTYPE, BYTES)  # [BLOCK_N, 32] float32
        w = _cast(w, x.dtype, EMULATE)  # the weights rounded to the activations' dtype
        if EMULATE:  # the interpreter's dot reads bfloat16 as raw bits: same values in float32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    dest = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(dest, _cast(acc, y_ptr.dtype.element_ty, EMULATE_OUT), mask=ok)


@triton.jit
def _gguf_rows(w_ptr, ids_ptr, y_ptr, K, stride_w, stride_y, QTYPE: tl.constexpr,
               BYTES: tl.constexpr, EMULATE: tl.constexpr):  # fmt: skip
    """Row ids[program] of W, decoded into row `program` of y."""
    i = tl.program_id(0).to(tl.int64)
    row_base = tl.load(ids_ptr + i).to(tl.int64) * stride_w + tl.zeros([1, 1], dtype=tl.int64)
    j = tl.arange(0, 32)[None, :]
    for k0 in range(0, K, 32):
        w = _decode(w_ptr, row_base, k0, j, QTYPE, BYTES)  # [1, 32]
        tl.store(y_ptr + i * stride_y + k0 + j, _cast(w, y_ptr.dtype.element_ty, EMULATE))


def _check(blocks: torch.Tensor, qtype: int) -> int:
    if int(qtype) not in TRITON_QTYPES:
        raise ValueError(f"the Triton GEMM does not decode {Q(qtype).name}")
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.stride(1) == 1
    return _BLOCK_BYTES[int(qtype)]


def gguf_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(blocks)^T (+ bias) -> [M, N] in `out_dtype` (x's by default), or
    into `out` (any row stride, unit column stride: a column slice of a wider output).
    blocks: uint8 [N, bytes per row] on x's device; x float32 / bfloat16 / float16."""
    block_bytes = _check(blocks, qtype)
    num_rows, in_features = x.shape
    out_features = blocks.shape[0]
    block = 256 if qtype in (_Q4_K, _Q6_K) else 32
    assert in_features % block == 0 and blocks.shape[1] == in_features // block * block_bytes
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(num_rows, out_features, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (num_rows, out_features) and out.stride(1) == 1
    if num_rows == 0 or out_features == 0:
        return out
    # Decode (a few rows): more programs along N keep the SMs busy; larger batches: tiles
    # big enough that each decoded weight serves 64 rows.
    block_m, block_n = (16, 32) if num_rows <= 16 else (64, 64)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    _gguf_matmul[grid](
        x, blocks, bias if bias is not None else x, out, num_rows, out_features, in_features,
        x.stride(0), blocks.stride(0), out.stride(0), QTYPE=int(qtype), BYTES=block_bytes,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EMULATE=INTERPRETED and x.dtype == torch.bfloat16,
        EMULATE_OUT=INTERPRETED and out.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def dequantize_rows(
    blocks: torch.Tensor, qtype: int, in_features: int, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` of the weight as [len(ids), in_features] in `dtype` (an embedding's
    lookup): float32 as gguf.quants.dequantize computes it."""
    block_bytes = _check(blocks, qtype)
    ids = ids.reshape(-1).to(device=blocks.device, dtype=torch.int64).contiguous()
    out = torch.empty(ids.numel(), in_features, dtype=dtype, device=blocks.device)
    if ids.numel():
        _gguf_rows[(ids.numel(),)](
            blocks, ids, out, in_features, blocks.stride(0), out.stride(0), QTYPE=int(qtype),
            BYTES=block_bytes, EMULATE=INTERPRETED and dtype == torch.bfloat16,
        )  # fmt: skip
    return out


def quantize_fp8(
    weight: torch.Tensor, per_channel: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, scale): `weight` [out, in] as e4m3fn with W ~= w8 * scale, scale float32 [out]
    (per output channel) or [] (per tensor): each row's (the tensor's) largest magnitude
    maps to e4m3's 448. Rounding to nearest: a weight's error is at most 2^-4 of itself
    (3 mantissa bits), or 2^-10 * scale below e4m3's normal range (its subnormal step)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    divisor = scale[:, None] if per_channel else scale
    w8 = (w / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8, scale


def dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [out, in]: w8 * scale (per channel or per tensor)."""
    return w8.float() * (scale[:, None] if scale.dim() else scale)


def can_scaled_mm(device: torch.device) -> bool:
    """FP8 tensor-core matmuls: CUDA at compute capability 8.9 (Ada) and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


Fp8Path = Literal["auto", "scaled_mm", "dequant"]


class Fp8Linear(nn.Module):
    """x @ W.T (+ bias) with W stored as e4m3fn and float32 scales (`quantize_fp8`).
    `path`: "auto" picks `_scaled_mm` where `can_scaled_mm` (falling back, logged, if
    this torch refuses the call) and the dequantizing path elsewhere."""

    def __init__(
        self, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = w8.shape
        self.register_buffer("w8", w8)  # [out, in] e4m3fn
        self.register_buffer("scale", scale)  # float32 [out] or []
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.path: Fp8Path = "auto"
        self._chosen: Fp8Path | None = None

    @classmethod
    def from_linear(cls, linear: nn.Module, per_channel: bool = True) -> Fp8Linear:
        w8, scale = quantize_fp8(linear.weight, per_channel)
        return cls(w8, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        path = self.path if self.path != "auto" else self._choose(rows)
        if path == "scaled_mm":
            try:
                out = self._scaled_mm(rows).to(x.dtype)
            except (RuntimeError, NotImplementedError) as e:
                if self.path != "auto":
                    raise
                log.warning("torch._scaled_mm refused %s (%s): FP8 weights dequantized instead",
                            tuple(rows.shape), e)  # fmt: skip
                self._chosen = "dequant"
                out = self._dequant(rows)
        else:
            out = self._dequant(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def _choose(self, rows: torch.Tensor) -> Fp8Path:
        if self._chosen is None:
            fits = self.in_features % 16 == 0 and self.out_features % 16 == 0
            self._chosen = "scaled_mm" if fits and can_scaled_mm(rows.device) else "dequant"
        return self._chosen

    def _dequant(self, rows: torch.Tensor) -> torch.Tensor:
        weight = dequantize_fp8(self.w8, self.scale).to(rows.dtype)
        bias = None if self.bias is None else self.bias.to(rows.dtype)
        return F.linear(rows, weight, bias)

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """Activations e4m3 with a scale per row (token), weights with theirs per output
        channel; float32 accumulation, bfloat16 out (what row-wise scaling returns)."""
        x = rows.float()
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [M, 1]
        x8 = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        w_scale = self.scale.expand(self.out_features).reshape(1, -1).contiguous()  # [1, N]
        out = torch._scaled_mm(x8, self.w8.t(), scale_a=x_scale, scale_b=w_scale,
                               out_dtype=torch.bfloat16)  # fmt: skip
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def describe(self) -> str:
        scales = "per-channel" if self.scale.dim() else "per-tensor"
        return f"FP8 e4m3 8 bits/weight ({scales} scales), {self._chosen or self.path} path"

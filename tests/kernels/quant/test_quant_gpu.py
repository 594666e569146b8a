"""The GPU's quantized linears (kernels/quant_gpu.py) against independent references: the
Triton GEMM over GGUF blocks against `gguf`'s own dequantization followed by a float64
matmul, and FP8 against the float64 matmul on the original weights, each within a bound
derived from the formats' rounding (stated per test). Without a GPU the Triton kernels run
in Triton's interpreter (shapes small) and `_scaled_mm` on the CPU where torch has it; the
`gpu` cases repeat them compiled on a device at model shapes (benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

# Without a GPU: TRITON_INTERPRET=1, set by tests/conftest.py before triton is imported.
from kernels import quant_gpu
from kernels.quant_linear import QuantWeight, random_weight

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if quant_gpu.available(DEVICE) is not None:
    pytest.skip(quant_gpu.available(DEVICE), allow_module_level=True)
QTYPES = [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K]
# Rounding of the dot's inputs to the activation dtype (half its ulp) and of a float16
# subnormal weight (absolute); float32 sums of K terms add at most K * 2^-24 of sum |x w|.
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11}
F16_SUBNORMAL = 2.0**-25


def _weight_blocks(qtype, out_features: int, in_features: int, seed: int) -> QuantWeight:
    """Legacy blocks quantized by gguf from random weights; K-quants (gguf cannot quantize
    them) random bytes with each block's float16 d (and Q4_K's dmin) drawn apart, so that
    a decode that swaps or misplaces them is seen."""
    if qtype not in (Q.Q4_K, Q.Q6_K):
        return random_weight(int(qtype), out_features, in_features, seed=seed)
    blocks = random_weight(int(qtype), out_features, in_features, seed=seed).blocks
    gen = torch.Generator().manual_seed(seed)
    size = 144 if qtype == Q.Q4_K else 210
    view = blocks.view(out_features, -1, size)
    # (byte offset, range): Q4_K's d and dmin an order of magnitude apart; Q6_K's d.
    fields = [(0, 1e-4, 3e-4), (2, 1e-3, 3e-3)] if qtype == Q.Q4_K else [(208, 1e-4, 1e-3)]
    for offset, low, high in fields:
        d = torch.empty(view.shape[:2]).uniform_(low, high, generator=gen).to(torch.float16)
        view[..., offset : offset + 2] = d.view(torch.uint8).reshape(*view.shape[:2], 2)
    return QuantWeight(blocks, int(qtype), in_features)


def _reference(weight) -> torch.Tensor:
    """gguf's float32 dequantization of the blocks, as float64 [out, in]."""
    values = dequantize(weight.blocks.cpu().numpy(), Q(weight.qtype))
    return torch.from_numpy(values.copy()).double()


def check_gguf_linear(qtype, rows, out_features, in_features, dtype, out_dtype, seed=0):
    """y = x @ W^T + b against the float64 matmul on gguf's dequantized W, elementwise:
    |y - ref| <= (r_in + r_out + K 2^-24) sum_k |x w| (+ float16's subnormal step), r the
    input and output dtypes' rounding; the output also written into a column slice."""
    weight = _weight_blocks(qtype, out_features, in_features, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = _reference(weight)
    products = x.double().abs() @ w.abs().T
    # A bias of the outputs' size: dropping or misplacing it exceeds any bound below.
    bias = torch.randn(out_features, generator=gen) * products.mean().float()
    blocks = weight.blocks.to(DEVICE)
    wide = torch.full((rows, out_features + 8), float("nan"), dtype=out_dtype, device=DEVICE)
    got = quant_gpu.gguf_linear(x.to(DEVICE), blocks, int(qtype), bias.to(DEVICE), wide[:, 3:-5])
    want = x.double() @ w.T + bias.double()
    magnitude = products + bias.double().abs()
    tol = ROUNDING[dtype] + ROUNDING[out_dtype] + in_features * 2.0**-24
    bound = tol * magnitude + 1e-30
    if dtype == torch.float16:
        bound += F16_SUBNORMAL * x.double().abs().sum(1, keepdim=True)
    err = (got.cpu().double() - want).abs()
    assert (err <= bound).all(), (Q(qtype).name, dtype, (err / bound).max().item())
    assert wide[:, :3].isnan().all() and wide[:, -5:].isnan().all()  # nothing past its columns
    assert not torch.equal(got.cpu().double(), torch.zeros_like(want))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gguf_linear_matches_the_dequantized_matmul(qtype, dtype):
    """Three rows (a decode batch; BLOCK_M masked), 40 outputs (BLOCK_N masked), two
    K-quant super-blocks or sixteen legacy blocks."""
    check_gguf_linear(qtype, 3, 40, 512, dtype, dtype)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0], ids=lambda q: q.name)
def test_gguf_linear_float16_and_larger_batches(qtype):
    """Float16 activations, float32 out (the LM head's logits); 70 rows: the 64-row tiles."""
    check_gguf_linear(qtype, 70, 24, 256, torch.float16, torch.float32, seed=3)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantize_rows_equals_gguf(qtype):
    """An embedding's lookup: rows in any order, repeated, the last one; float32 equal to
    gguf's bit for bit in the interpreter (a GPU may fuse Q4_K's multiply-subtract)."""
    weight = _weight_blocks(qtype, 20, 512, seed=5)
    ids = torch.tensor([[19, 0], [7, 7]])
    got = quant_gpu.dequantize_rows(weight.blocks.to(DEVICE), int(qtype), 512, ids, torch.float32)
    want = _reference(weight).float()[ids.reshape(-1)]
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.cpu(), want, rtol=2.0**-22, atol=want.abs().max() * 2**-22)
    rows16 = quant_gpu.dequantize_rows(weight.blocks.to(DEVICE), int(qtype), 512, ids,
                                       torch.bfloat16)  # fmt: skip
    assert torch.equal(rows16.cpu(), want.bfloat16())  # rounded to nearest even, as torch


def test_unsupported_block_types_are_refused():
    with pytest.raises(ValueError, match="does not decode Q2_K"):
        quant_gpu.gguf_linear(torch.zeros(1, 256), torch.zeros(1, 84, dtype=torch.uint8), Q.Q2_K)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_gguf_linear_compiled_at_model_shapes(qtype):
    """The compiled kernel on the GPU at Gemma 3 270M's widths: 640 in (1,024 out), 2,048
    in (640 out), 1 / 64 / 300 rows in bfloat16 (both tile shapes), float32 for one type
    (each case is a compilation: device time)."""
    cases = [(1, (1024, 640), torch.bfloat16), (64, (640, 2048), torch.bfloat16),
             (300, (1024, 640), torch.bfloat16)]  # fmt: skip
    if qtype == Q.Q4_K:
        cases.append((64, (640, 2048), torch.float32))
    for rows, (out_features, in_features), dtype in cases:
        if in_features % 256 and qtype in (Q.Q4_K, Q.Q6_K):
            in_features = 768
        check_gguf_linear(qtype, rows, out_features, in_features, dtype, dtype, seed=rows)


# -- FP8 ------------------------------------------------------------------------------------

# e4m3 rounds to nearest with 3 mantissa bits: a normal value's error is at most 2^-4 of
# itself; below the normal range (2^-6 of the scale) the step is 2^-9 of the scale.
FP8_RELATIVE, FP8_SUBNORMAL = 2.0**-4, 2.0**-10


def _weight(out_features=48, in_features=64, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    w[1] *= 40  # a row of outliers (its own scale, per channel)
    w[2] = 0  # an all-zero row
    w[3, :8] = 1e-6  # values far below e4m3's normal range
    return w


def _fp8_error_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale[:, None] if scale.dim() else scale
    return (FP8_RELATIVE + 2.0**-20) * w.abs() + FP8_SUBNORMAL * s


@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_fp8_round_trip_is_within_e4m3s_rounding(per_channel):
    w = _weight()
    w8, scale = quantize_fp8 = quant_gpu.quantize_fp8(w, per_channel)
    assert w8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == ((48,) if per_channel else ())
    back = quant_gpu.dequantize_fp8(*quantize_fp8)
    err = (back - w).abs()
    assert (err <= _fp8_error_bound(w, scale)).all(), (err / _fp8_error_bound(w, scale)).max()
    assert torch.equal(back[2], torch.zeros(64))
    # Values on e4m3's grid (each row's largest at 448, a power-of-two scale) come back exact.
    grid = w8.float()
    grid[:, 0] = 448.0
    exact = grid * 2.0**-7
    assert torch.equal(quant_gpu.dequantize_fp8(*quant_gpu.quantize_fp8(exact)), exact)


def _fp8_linear_bound(x, w, scale, activations_fp8: bool, out_rounding: float) -> torch.Tensor:
    """|y - x W^T| elementwise: the weights' rounding; with FP8 activations, each row's
    rounding at its own scale (amax / 448) too; then the output's rounding."""
    x, w = x.double(), w.double()
    ew = _fp8_error_bound(w, scale.double())
    if activations_fp8:
        s_x = x.abs().amax(1, keepdim=True) / 448
        ex = FP8_RELATIVE * x.abs() + FP8_SUBNORMAL * s_x
        bound = ex @ (w.abs() + ew).T + x.abs() @ ew.T
    else:
        bound = x.abs() @ ew.T
    magnitude = x.abs() @ w.abs().T
    return bound + (out_rounding + 1e-6) * (magnitude + bound)


def test_fp8_linear_dequantizing_path_within_its_bound():
    w = _weight()
    gen = torch.Generator().manual_seed(9)
    x, bias = torch.randn(5, 64, generator=gen), torch.randn(48, generator=gen)
    linear = torch.nn.Linear(64, 48)
    linear.weight.data, linear.bias.data = w, bias
    layer = quant_gpu.Fp8Linear.from_linear(linear)
    layer.path = "dequant"
    got = layer(x.reshape(5, 1, 64)).reshape(5, 48)
    want = x.double() @ w.double().T + bias.double()
    err = (got.double() - want).abs()
    bound = _fp8_linear_bound(x, w, layer.scale, False, 0.0)
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # the weights were rounded: not the float32 layer run again


def _scaled_mm_layer(w: torch.Tensor) -> quant_gpu.Fp8Linear:
    layer = quant_gpu.Fp8Linear(*quant_gpu.quantize_fp8(w))
    layer.path = "scaled_mm"
    return layer.to(DEVICE)


def check_scaled_mm(rows: int, out_features: int, in_features: int, layer=None) -> None:
    w = _weight(out_features, in_features, seed=rows)
    layer = layer or _scaled_mm_layer(w)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    x[0] *= 100  # a token of outliers: its own activation scale
    x = x.bfloat16()
    try:
        got = layer(x.to(DEVICE)).cpu()
    except (RuntimeError, NotImplementedError) as e:  # this torch's CPU has no FP8 GEMM
        if DEVICE.type == "cuda":
            raise  # a GPU that should run it: a failure, not a skip
        pytest.skip(f"torch._scaled_mm on {DEVICE}: {e}")
    assert got.dtype == torch.bfloat16
    want = x.double() @ w.double().T
    err = (got.double() - want).abs()
    bound = _fp8_linear_bound(x.float(), w, layer.scale.cpu(), True, 2.0**-9)
    assert (err <= bound).all(), (err / bound).max()


def test_fp8_linear_scaled_mm_path_within_its_bound():
    """torch._scaled_mm as the GPU calls it (row-wise scales: per token, per channel),
    here on the CPU where this torch implements it."""
    check_scaled_mm(6, 48, 64)


@pytest.mark.gpu
def test_fp8_linear_picks_scaled_mm_on_the_gpu():
    """On an FP8 GPU (sm_89+) "auto" takes `_scaled_mm`, within its bound, at 1, 64 and
    300 tokens of a 2,048 x 1,024 projection."""
    for rows in (1, 64, 300):
        w = _weight(2048, 1024, seed=rows)
        layer = quant_gpu.Fp8Linear(*quant_gpu.quantize_fp8(w)).to(DEVICE)
        check_scaled_mm(rows, 2048, 1024, layer)
        want = "scaled_mm" if quant_gpu.can_scaled_mm(DEVICE) else "dequant"
        assert layer.describe().endswith(f"{want} path"), layer.describe()

"""The CPU kernels in bfloat16 against float32 / float64 references of the same
bfloat16-rounded inputs, each within a stated bound.

The bounds: bfloat16 keeps 8 significant bits, so one rounding of a result is off by at
most 2^-9 of it (half an ulp, `HALF_ULP`). A kernel that sums in float32 and rounds its
output once must stay within one such rounding (plus float32 summation noise) of the
exact result; the eager bfloat16 ops round after every op and are further off. The
attention kernels read a bfloat16 cache as float32: with float32 queries they must match
a float64 reference of the rounded K/V to float32 accuracy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_attention, fused_ops, lm_head, packed_linear
from tests.kernels.test_prefill_attention import paged_problem, reference

BF16 = torch.bfloat16
HALF_ULP = 2.0**-8  # the largest relative error of one rounding to bfloat16 (8 bits)


def within(out: torch.Tensor, exact: torch.Tensor, roundings: float, floor: float) -> None:
    """|out - exact| <= roundings * HALF_ULP * |exact| + floor, elementwise."""
    out, exact = out.double(), exact.double()
    bound = roundings * HALF_ULP * exact.abs() + floor
    excess = (out - exact).abs() - bound
    assert excess.max() <= 0, f"max error past the bound: {excess.max().item():.3g}"


# The C++ kernels build on first use: checked when a test needs them, never at collection
# (a GPU machine's `pytest -m gpu` would build them all for nothing).
@pytest.fixture
def fused_kernels():
    if fused_ops.available() is not None:
        pytest.skip("no fused kernels")


@pytest.fixture
def skinny_kernel():
    if packed_linear.skinny_available() is not None:
        pytest.skip("no skinny kernel")


@pytest.fixture
def attention_kernels():
    if cpu_attention.available() is not None or cpu_attention.prefill_available() is not None:
        pytest.skip("the CPU attention kernels did not build")


needs_fused = pytest.mark.usefixtures("fused_kernels")
needs_skinny = pytest.mark.usefixtures("skinny_kernel")
needs_attention = pytest.mark.usefixtures("attention_kernels")


@needs_fused
def test_rms_norm_bf16_rounds_once_from_the_float32_result():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 256, generator=gen) * 3).to(BF16)
    weight = (1 + torch.randn(256, generator=gen) / 4).to(BF16)
    out = fused_ops.rms_norm(x, weight, 1e-6, fused=True)
    assert out.dtype == BF16
    # transformers' order: normalised in float32, rounded to bfloat16, times the weight
    exact = weight.double() * fused_ops.rms_norm_eager(x.double(), torch.ones(256), 1e-6)
    within(out, exact, roundings=2.02, floor=1e-6)
    eager = fused_ops.rms_norm_eager(x, weight, 1e-6)  # what the unfused bf16 path gives
    torch.testing.assert_close(out, eager, rtol=2 * HALF_ULP, atol=0)


@needs_fused
def test_add_rms_norm_bf16_matches_the_eager_ops():
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(19, 128, generator=gen).to(BF16) for _ in range(2))
    weight = torch.randn(128, generator=gen).to(BF16)
    want_norm, want_sum = fused_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, False)
    norm, total = fused_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, True)
    torch.testing.assert_close(total, want_sum, rtol=0, atol=0)  # one rounded add either way
    torch.testing.assert_close(norm, want_norm, rtol=2 * HALF_ULP, atol=0)


@needs_fused
def test_rope_bf16_rounds_once():
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(11, 6 * 64, generator=gen).to(BF16)  # q: 4 heads, k: 2 heads
    angles = torch.randn(11, 32, generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(BF16) for f in (torch.cos, torch.sin))
    q, k = qkv[:, :256].view(11, 4, 64), qkv[:, 256:].view(11, 2, 64)
    exact_q = fused_ops.rope_eager(q.double(), cos.double(), sin.double())
    exact_k = fused_ops.rope_eager(k.double(), cos.double(), sin.double())
    out_q, out_k = fused_ops.rope(q, k, cos, sin, fused=True)
    # one rounding of the result; the float32 products cancel down to ~2^-24 of |x|
    within(out_q, exact_q, roundings=1.01, floor=1e-6)
    within(out_k, exact_k, roundings=1.01, floor=1e-6)


@needs_fused
def test_silu_and_mul_bf16_rounds_once():
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(9, 2 * 300, generator=gen) * 4).to(BF16)  # 300: a vector tail
    out = fused_ops.silu_and_mul(gate_up, fused=True)
    exact = fused_ops.silu_and_mul_eager(gate_up.double())
    within(out, exact, roundings=1.05, floor=1e-6)  # exp_ps: ~2 float32 ulp


@needs_skinny
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("in_features, out_features", [(256, 96), (100, 13), (2048, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_bf16_matches_a_float64_reference(rows, in_features, out_features, bias):
    """Products of bfloat16 values are exact in float32; the sums add float32 rounding
    (~K * 2^-24 of the sum of |products|); the output one bfloat16 rounding."""
    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(BF16)
    weight = (torch.randn(out_features, in_features, generator=gen) / 16).to(BF16)
    b = torch.randn(out_features, generator=gen).to(BF16) if bias else None
    out = packed_linear.skinny_linear(x, weight, b)
    assert out.dtype == BF16
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = HALF_ULP * exact.abs() + in_features * 2.0**-24 * magnitude + 1e-30
    assert ((out.double() - exact).abs() <= bound).all()


@needs_skinny
@pytest.mark.parametrize("rows", [1, 5, 64, 203])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_bf16_float_out_is_the_unrounded_float32_sum(rows, bias):
    """The LM head's path: bfloat16 in, float32 out. Products of bfloat16 values are exact
    in float32, so the output is within float32 summation noise (K * 2^-24 of the sum of
    |products|) of the exact result, with no bfloat16 rounding on top."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 300, generator=gen).to(BF16)  # 300: a vector tail
    weight = (torch.randn(97, 300, generator=gen) / 16).to(BF16)
    b = torch.randn(97, generator=gen).to(BF16) if bias else None
    out = packed_linear.skinny_linear(x, weight, b, torch.float32)
    assert out.dtype == torch.float32
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    assert ((out.double() - exact).abs() <= 300 * 2.0**-24 * magnitude + 1e-30).all()
    # not rounded: most outputs are no bfloat16 value (a rounded output would all be)
    assert (out.to(BF16).float() != out).float().mean() > 0.9


@needs_skinny
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("gemm", ["packed", "plain"])
def test_lm_head_gives_float32_logits_in_bf16(tied, gemm, monkeypatch):
    """`linear_float`, the decoder's LM head: the float32 sums up to the calibrated rows
    (a packed head's plain weight or the tied embedding), a bfloat16 GEMM's output widened
    past them (one bfloat16 rounding)."""
    if not packed_linear.packable(BF16):
        pytest.skip("oneDNN takes no bfloat16 on this CPU (the head stays plain)")
    limit = 16  # whatever this CPU's calibration chose
    choice = packed_linear.calibration.HeadChoice(limit, gemm)
    monkeypatch.setattr(lm_head, "head_choice", lambda *a: choice)
    torch.manual_seed(6)
    head = nn.Linear(128, 500, bias=False).to(BF16)
    layer = None if tied else packed_linear.PackedLinear(head, plain=True)
    for rows, roundings in ((1, 0), (limit, 0), (limit + 1, 1)):
        x = torch.randn(rows, 128).to(BF16)
        logits = lm_head.linear_float(layer, x, head.weight.detach())
        assert logits.dtype == torch.float32 and logits.shape == (rows, 500)
        exact = x.double() @ head.weight.double().T
        magnitude = x.double().abs() @ head.weight.double().abs().T
        bound = 128 * 2.0**-24 * magnitude + roundings * HALF_ULP * exact.abs() + 1e-30
        assert ((logits.double() - exact).abs() <= bound).all()


def test_packed_linear_bf16_layers_match_float32_on_the_same_weights():
    """oneDNN's bfloat16 GEMM (float32 accumulation, one output rounding) and its fused
    GELU / residual epilogues, against float32 layers holding the same rounded weights."""
    if not packed_linear.packable(BF16):
        pytest.skip("oneDNN takes no bfloat16 on this CPU")
    torch.manual_seed(4)
    layer = nn.Linear(192, 80).to(BF16)
    packed = packed_linear.PackedLinear(layer, plain=True)
    ref = nn.Linear(192, 80)
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    for rows in (2, 40, 300):  # the skinny kernel, then oneDNN
        x = torch.randn(rows, 192).to(BF16)
        residual = torch.randn(rows, 80).to(BF16)
        exact = ref(x.float()).double()
        magnitude = x.double().abs() @ ref.weight.double().abs().T + ref.bias.double().abs()
        # one output rounding; float32 sums; oneDNN may round its bias add separately
        bound = 2 * HALF_ULP * magnitude + 1e-6
        assert ((packed(x).double() - exact).abs() <= bound).all()
        act = packed_linear.linear_act(packed, x, "gelu").double()
        assert ((act - F.gelu(exact)).abs() <= bound + HALF_ULP * act.abs()).all()
        added = packed_linear.linear_add(packed, x, residual).double()
        want = exact + residual.double()
        assert ((added - want).abs() <= bound + 2 * HALF_ULP * want.abs()).all()


SHAPES = [(0, 40), (70, 25), (5, 100), (33, 1), (120, 1), (16, 3)]  # prefills, decodes


def run_both(shapes, q_dtype, cache_dtype):
    """Both kernels over `shapes` (decode kernel for query lens <= 4) with K/V rounded to
    bfloat16 in a `cache_dtype` cache and q in `q_dtype`; returns (q, k, v) per sequence
    and the output."""
    seqs, cache, q, batch = paged_problem(shapes, 8, 2, 64, 16, BF16, seed=5)
    cache, q = cache.to(cache_dtype), q.to(q_dtype)
    starts = [sum(batch.query_lens[:i]) for i in range(len(shapes))]
    small = [i for i, n in enumerate(batch.query_lens) if n <= 4]
    large = [i for i, n in enumerate(batch.query_lens) if n > 4]
    out = torch.full(q.shape, float("nan"), dtype=q_dtype)
    for kernel, members in ((torch.ops.vlmserve.paged_attention, small),
                            (torch.ops.vlmserve_prefill.prefill_attention, large)):  # fmt: skip
        p = cpu_attention.paged_rows(batch, starts, members)
        kernel(out, q, cache, p.block_tables, p.query_starts, p.query_lens, p.context_lens,
               16, 64**-0.5)  # fmt: skip
    return seqs, starts, out


@needs_attention
@pytest.mark.parametrize(
    "q_dtype, cache_dtype, rtol, atol",
    [
        (torch.float32, BF16, 1e-4, 1e-5),  # a bf16 cache under float32 weights: exact reads
        (BF16, torch.float32, 2 * HALF_ULP, 1e-3),  # a float32 cache under bf16 weights
    ],
)
def test_attention_kernels_read_a_bf16_cache_in_float32(q_dtype, cache_dtype, rtol, atol):
    seqs, starts, out = run_both(SHAPES, q_dtype, cache_dtype)
    for (q, k, v), start in zip(seqs, starts, strict=True):
        exact = reference(q, k, v, 64**-0.5)  # float64 of the bf16-rounded q, k, v
        got = out[start : start + len(q)].double()
        torch.testing.assert_close(got, exact, rtol=rtol, atol=atol)


@needs_attention
def test_attention_kernels_in_bf16_throughout():
    """q and cache in bfloat16: the prefill kernel may run on AVX-512 BF16 dot products,
    which round each probability to bfloat16 before P V (as FlashAttention does). Bound:
    one output rounding, plus one rounding of every probability, i.e. half an ulp of
    sum_j p_j |v_j| (the reference's probabilities over |v|), and float32 sums."""
    seqs, starts, out = run_both(SHAPES, BF16, BF16)
    for (q, k, v), start in zip(seqs, starts, strict=True):
        exact = reference(q, k, v, 64**-0.5)
        weighted = reference(q, k, v.abs(), 64**-0.5)  # sum_j p_j |v_j|
        got = out[start : start + len(q)].double()
        bound = 2 * HALF_ULP * exact.abs() + HALF_ULP * weighted + 1e-5
        assert ((got - exact).abs() <= bound).all(), (got - exact).abs().max()
        # and not looser than that: a wrong key or a lost pair would be far outside
        assert (got - exact).abs().max() < 0.02


@pytest.mark.parametrize("dim", [32, 72])  # 72: SigLIP-so400m's head dim (a masked tail)
def test_tile_attention_is_full_attention_within_each_tile(dim):
    """The vision tower's bfloat16 attention on the prefill kernel: every tile's patches
    see each other in full and nothing of another tile, against float64 attention per tile
    on the same bf16 values (bound as above)."""
    if not cpu_attention.bf16_dot_available():
        pytest.skip("the prefill kernel has no AVX-512 BF16 dot products on this CPU")
    torch.manual_seed(6)
    tiles, patches, heads = 3, 37, 4
    qkv = torch.randn(tiles * patches, 3 * heads * dim).to(BF16)
    got = cpu_attention.tile_attention(qkv, tiles, heads, dim**-0.5).double()
    exact, weighted = tile_reference(qkv, tiles, heads, dim)
    bound = 2 * HALF_ULP * exact.abs() + HALF_ULP * weighted + 1e-5
    assert ((got - exact).abs() <= bound).all(), (got - exact).abs().max()


def tile_reference(qkv: torch.Tensor, tiles: int, heads: int, dim: int):
    """float64 attention within each tile: (P V, P |V|) as [tiles * patches, heads * dim]."""
    patches = qkv.shape[0] // tiles
    q, k, v = qkv.double().view(tiles, patches, 3, heads, dim).permute(2, 0, 3, 1, 4)
    probs = (q @ k.transpose(-1, -2) * dim**-0.5).softmax(-1)  # [tiles, heads, p, p]
    flat = lambda x: x.transpose(1, 2).reshape(tiles * patches, heads * dim)  # noqa: E731
    return flat(probs @ v), flat(probs @ v.abs())


def test_tile_attention_in_float32():
    """The float32 tower's attention on the prefill kernel (large tiles): float32 math,
    equal to float64 attention per tile to float32 rounding."""
    if cpu_attention.prefill_available() is not None:
        pytest.skip("the prefill kernel did not build here")
    torch.manual_seed(7)
    tiles, patches, heads, dim = 2, 70, 3, 24
    qkv = torch.randn(tiles * patches, 3 * heads * dim)
    got = cpu_attention.tile_attention(qkv, tiles, heads, dim**-0.5).double()
    exact, _ = tile_reference(qkv, tiles, heads, dim)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6)


@needs_fused
def test_gelu_tanh_and_mul_bf16_rounds_once():
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(9, 2 * 300, generator=gen) * 4).to(BF16)  # 300: a vector tail
    out = fused_ops.gelu_tanh_and_mul(gate_up, fused=True)
    exact = fused_ops.gelu_tanh_and_mul_eager(gate_up.double())
    within(out, exact, roundings=1.05, floor=1e-6)  # exp_ps: ~2 float32 ulp
    eager = fused_ops.gelu_tanh_and_mul_eager(gate_up)  # rounds twice: no closer
    assert (out.double() - exact).abs().sum() <= (eager.double() - exact).abs().sum()

"""The fused CPU elementwise kernels against their eager references (kernels/fused_ops.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_ops


@pytest.fixture(autouse=True)
def needs_the_fused_kernels():
    """They build on first use: when a test here runs, never at collection."""
    if (why := fused_ops.available()) is not None:
        pytest.skip(f"fused kernels did not build: {why}")


# Widths that are and are not multiples of the 16-lane vectors; a row count past a thread's
# grain so both threads work.
WIDTHS = [64, 100, 768, 2050]


@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_eager(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(37, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    fused = fused_ops.rms_norm(x, weight, 1e-6, fused=True)
    torch.testing.assert_close(
        fused, fused_ops.rms_norm_eager(x, weight, 1e-6), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_matches_eager(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x, residual = torch.randn(2, 37, width, generator=gen)
    weight = torch.randn(width, generator=gen)
    want_norm, want_sum = fused_ops.add_rms_norm(x, residual, weight, 1e-5, fused=False)
    norm, total = fused_ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5, fused=True)
    assert torch.equal(total, want_sum)  # one float add per element: bit-identical
    torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 4, 64), (6, 6, 32), (8, 1, 128)])
def test_rope_in_place_on_qkv_views_is_bit_identical(heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    n = 41
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = torch.randn(2, n, dim, generator=gen)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(n, heads, dim), k.view(n, kv_heads, dim)
    want_q, want_k = fused_ops.rope_eager(q, cos, sin), fused_ops.rope_eager(k, cos, sin)
    v_before = v.clone()
    got_q, got_k = fused_ops.rope(q, k, cos, sin, fused=True)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the qkv buffer
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, v_before)  # v, between k's heads and the row's end, untouched


@pytest.mark.parametrize("width", [16, 100, 2048])
def test_silu_and_mul_matches_eager(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(19, 2 * width, generator=gen) * 8  # well into both tails of silu
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    want = fused_ops.silu_and_mul_eager(gate_up)
    torch.testing.assert_close(
        fused_ops.silu_and_mul(gate_up, fused=True), want, rtol=2e-6, atol=1e-7
    )


def test_other_dtypes_take_the_eager_path() -> None:
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    out = fused_ops.rms_norm(x, weight, 1e-6, fused=True)
    assert torch.equal(out, fused_ops.rms_norm_eager(x, weight, 1e-6))


@pytest.mark.parametrize("width", [16, 100, 2048])
def test_gelu_tanh_and_mul_matches_eager(width: int) -> None:
    """Gemma's MLP: GELU-tanh as x / (1 + e^-2y), y its tanh argument, fused with the mul."""
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(19, 2 * width, generator=gen) * 6  # well into both tails of gelu
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -3e4, 3e4])
    want = fused_ops.gelu_tanh_and_mul_eager(gate_up)
    got = fused_ops.gelu_tanh_and_mul(gate_up, fused=True)
    exact = fused_ops.gelu_tanh_and_mul_eager(gate_up.double())
    torch.testing.assert_close(got.double(), exact, rtol=4e-6, atol=1e-12)  # 1e-12: float64 tanh
    # The eager float32 op is further off where gate << 0: 1 + tanh(y) cancels there.
    gate, up = gate_up.chunk(2, dim=-1)
    assert ((got - want).abs() <= 2e-6 * want.abs() + 1.2e-7 * (gate * up).abs()).all()
    assert torch.equal(fused_ops.gelu_tanh_and_mul(gate_up, fused=False), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "norms"),
                         [(4, 1, 256, True), (12, 4, 64, False), (6, 6, 32, True)])  # fmt: skip
def test_qkv_to_cache_matches_norm_rope_and_the_cache_write(
    heads: int, kv_heads: int, dim: int, norms: bool, dtype: torch.dtype
) -> None:
    """q out and k, v in the cache at scattered slots, bit for bit as the separate fused ops
    (rms_norm per head, rope, index_copy_) compute them; other slots untouched."""
    gen = torch.Generator().manual_seed(dim + heads)
    n, num_slots, eps = 19, 64, 1e-6
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(dtype)
    cos, sin = (t.to(dtype) for t in torch.randn(2, n, dim, generator=gen))
    weights = tuple(torch.randn(dim, generator=gen).to(dtype) for _ in "qk")
    slots = torch.randperm(num_slots, generator=gen)[:n]
    cache = torch.randn(2, kv_heads, num_slots, dim, generator=gen).to(dtype)
    before = cache.clone()

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(n * heads, dim), k.reshape(n * kv_heads, dim)
    if norms:
        q, k = (
            fused_ops.rms_norm(x, w, eps, fused=True) for x, w in zip((q, k), weights, strict=True)
        )
    want_q, want_k = fused_ops.rope(
        q.view(n, heads, dim).clone(), k.view(n, kv_heads, dim).clone(), cos, sin, fused=True
    )
    got_q = fused_ops.qkv_to_cache(
        qkv, heads, dim, (*weights, eps) if norms else None, cos, sin, cache, slots
    )
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache[0][:, slots], want_k.transpose(0, 1))
    assert torch.equal(cache[1][:, slots], v.reshape(n, kv_heads, dim).transpose(0, 1))
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(cache[:, :, others], before[:, :, others])
    # and within rounding of the eager definitions
    eager_q = q if not norms else fused_ops.rms_norm_eager(
        qkv[:, : heads * dim].reshape(n * heads, dim), weights[0], eps)  # fmt: skip
    eager_q = fused_ops.rope_eager(eager_q.view(n, heads, dim), cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_q.float(), eager_q.float(), rtol=tol, atol=tol)


def test_qkv_to_cache_refuses_a_slot_outside_the_cache() -> None:
    qkv = torch.randn(2, 3 * 32)
    cache = torch.zeros(2, 1, 8, 32)
    cos = sin = torch.ones(2, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused_ops.qkv_to_cache(qkv, 1, 32, None, cos, sin, cache, torch.tensor([3, 8]))
    assert not cache.any()  # checked before anything is written


def test_op_backends_say_where_qkv_takes_the_one_op() -> None:
    """`vlmserve info`'s line: the CPU backend always, its SDPA variant only in steps
    without a prefill (SDPA reads k and v), never unfused or on the torch backend."""
    cpu, key = torch.device("cpu"), "qk_norm_rope_kv_write"
    assert fused_ops.op_backends(cpu, "cpu")[key] == "cpu C++ (one op from the qkv output)"
    assert "decode-only" in fused_ops.op_backends(cpu, "cpu-sdpa")[key]
    assert fused_ops.op_backends(cpu, "torch")[key] == "separate ops"
    assert fused_ops.op_backends(cpu, "cpu", fused=False)[key] == "separate ops"

"""The decoder layer's fused elementwise ops in Triton, for GPU tensors: residual add +
RMSNorm, and RoPE + the K/V cache write through the slot mapping.

Their references are the eager definitions in kernels/fused_ops.py (`rms_norm_eager`,
`rope_eager`) plus the torch backend's `index_copy_` cache write. Each kernel reads its
inputs once and writes its outputs once: on a GPU the eager versions launch five to ten
kernels each and move every activation through memory several times, which at batch-1
decode is launch overhead on top of bandwidth. Like the attention kernels they run on a
CPU only under TRITON_INTERPRET=1 (how CI tests them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(
    x_ptr, res_ptr, w_ptr, stride_x, stride_r, n_cols, eps, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
    summed = x + r  # in the activation dtype, as the eager `x + residual`
    tl.store(res_ptr + row * stride_r + cols, summed, mask=ok)
    s = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(x_ptr + row * stride_x + cols, w * (s * inv).to(x.dtype), mask=ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [tokens, hidden] rows, overwriting both
    inputs (as the CPU fused op does)."""
    rows, cols = x.shape
    if rows:
        _add_rms_norm[(rows,)](
            x, residual, weight, x.stride(0), residual.stride(0), cols, eps,
            BLOCK=triton.next_power_of_2(cols),
        )  # fmt: skip
    return x, residual


@triton.jit
def _rotate(ptr, base, heads, stride_h, c1, c2, s1, s2, HALF: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotate `heads` rows of [head_dim] at ptr + base in place; returns them (x1, x2)."""
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    ok = (h < heads)[:, None] & (i < HALF)[None, :]
    first = ptr + base + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(first, mask=ok, other=0.0)
    x2 = tl.load(first + HALF, mask=ok, other=0.0)
    # rope_eager: x * cos + cat(-x2, x1) * sin, per half.
    y1 = x1 * c1[None, :] - x2 * s1[None, :]
    y2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(first, y1, mask=ok)
    tl.store(first + HALF, y2, mask=ok)
    return y1, y2, ok


@triton.jit
def _rope_kv_write(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_ckv, stride_ch, stride_cs, heads, kv_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    trig = token * stride_cos + i
    c1 = tl.load(cos_ptr + trig, mask=i_ok, other=0.0)
    c2 = tl.load(cos_ptr + trig + HALF, mask=i_ok, other=0.0)
    s1 = tl.load(sin_ptr + trig, mask=i_ok, other=0.0)
    s2 = tl.load(sin_ptr + trig + HALF, mask=i_ok, other=0.0)
    _rotate(q_ptr, token * stride_qt, heads, stride_qh, c1, c2, s1, s2, HALF, BLOCK_H,
            BLOCK_HALF)  # fmt: skip
    k1, k2, ok = _rotate(k_ptr, token * stride_kt, kv_heads, stride_kh, c1, c2, s1, s2, HALF,
                         BLOCK_KVH, BLOCK_HALF)  # fmt: skip
    slot = tl.load(slot_ptr + token)
    ok = ok & (slot >= 0)  # a negative slot (a padded CUDA-graph row) writes nothing
    h = tl.arange(0, BLOCK_KVH)
    dest = cache_ptr + h[:, None] * stride_ch + slot * stride_cs + i[None, :]
    tl.store(dest, k1, mask=ok)
    tl.store(dest + HALF, k2, mask=ok)
    src = v_ptr + token * stride_vt + h[:, None] * stride_vh + i[None, :]
    tl.store(dest + stride_ckv, tl.load(src, mask=ok, other=0.0), mask=ok)
    tl.store(dest + stride_ckv + HALF, tl.load(src + HALF, mask=ok, other=0.0), mask=ok)


def rope_and_cache_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
) -> None:  # fmt: skip
    """RoPE on q [tokens, heads, dim] and k [tokens, kv_heads, dim] in place (they may be
    views into one qkv output), and the rotated k and v written to
    kv_cache [2, kv_heads, slots, dim] at slot_mapping [tokens]."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if not tokens:
        return
    assert q.stride(2) == k.stride(2) == v.stride(2) == kv_cache.stride(3) == 1
    assert cos.stride(1) == sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    half = dim // 2
    _rope_kv_write[(tokens,)](
        q, k, v, cos, sin, slot_mapping, kv_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        heads, kv_heads, HALF=half, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KVH=triton.next_power_of_2(kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
    )  # fmt: skip

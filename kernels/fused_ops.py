"""The decoder layer's elementwise ops, fused (C++ on a CPU) or eager (the reference).

Each eager function here is the plain-torch definition the decoder used before fusion;
the fused ones (kernels/csrc/fused_ops_cpu.cpp) read their inputs once and write their
outputs once and are tested against these. At a large prefill chunk the eager RMSNorms,
residual adds, RoPE and SiLU·mul (GELU-tanh·mul for Gemma), each a pass over memory, are
a noticeable share of the step on a CPU.
The fused path runs for float32 and bfloat16 CPU tensors where the kernels build
(bfloat16 in and out, float32 inside: within a bfloat16 rounding or two of the eager ops,
which round after every op; tests/kernels/test_bf16.py). `qkv_to_cache` takes the
attention's inputs from the qkv projection in one pass (QK-norm, RoPE, the K/V cache write):
at a decode step of a small model those ops cost more than the attention. On a GPU the residual
add + RMSNorm is the Triton kernel in kernels/triton_ops.py (RoPE is fused into the Triton
attention backend's K/V write); anything else takes the eager path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_build


def available() -> str | None:
    """None when the fused CPU kernels are built and loaded; otherwise why not."""
    return cpu_build.load("fused_ops_cpu")


FUSED_DTYPES = (torch.float32, torch.bfloat16)


def can_fuse(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in FUSED_DTYPES and available() is None


# -- eager references -----------------------------------------------------------------


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers (normalise in float32, scale in the input dtype).
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_eager(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# -- dispatching ops --------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
    if not (fused and can_fuse(x)):
        return rms_norm_eager(x, weight, eps)
    out = torch.empty_like(x)
    torch.ops.vlmserve_fused.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). The fused op overwrites both inputs."""
    if fused and x.is_cuda:  # the Triton kernel (imported here: triton is GPU-side)
        from kernels import triton_ops

        return triton_ops.add_rms_norm(x, residual, weight, eps)
    if not (fused and can_fuse(x)):
        residual = x + residual
        return rms_norm_eager(residual, weight, eps), residual
    torch.ops.vlmserve_fused.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [tokens, heads, dim] and k [tokens, kv_heads, dim]; the fused op works in
    place (q and k may be views into one qkv output)."""
    if not (fused and can_fuse(q)):
        return rope_eager(q, cos, sin), rope_eager(k, cos, sin)
    torch.ops.vlmserve_fused.rotary_embedding(q, k, cos, sin)
    return q, k


def silu_and_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dim."""
    if not (fused and can_fuse(gate_up)):
        return silu_and_mul_eager(gate_up)
    out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    torch.ops.vlmserve_fused.silu_and_mul(out, gate_up)
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up] on the last dim (Gemma's MLP)."""
    if not (fused and can_fuse(gate_up)):
        return gelu_tanh_and_mul_eager(gate_up)
    out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    torch.ops.vlmserve_fused.gelu_tanh_and_mul(out, gate_up)
    return out


def qkv_to_cache(
    qkv: torch.Tensor,
    num_heads: int,
    head_dim: int,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q [tokens, num_heads, head_dim] from the fused projection's output qkv, whose k and
    v go straight into kv_cache [2, kv_heads, slots, head_dim] at `slots`: the QK-norm
    (`norms`: q's weight, k's, eps; Gemma 3), RoPE and the cache write in one pass, bit for
    bit as rms_norm, rope and the backend's write. Needs `can_fuse(qkv)` and a cache in
    qkv's dtype."""
    q = qkv.new_empty(qkv.shape[0], num_heads, head_dim)
    q_weight, k_weight, eps = norms if norms is not None else (None, None, 0.0)
    torch.ops.vlmserve_fused.qkv_to_cache(
        q, kv_cache, qkv, q_weight, k_weight, eps, cos, sin, slots
    )
    return q


def op_backends(
    device: torch.device, attention: str, fused: bool = True, dtype: torch.dtype = torch.float32
) -> dict[str, str]:
    """Which implementation serves each decoder op on `device` with the `attention`
    backend in `dtype` (what `vlmserve info` reports). `fused`: ModelConfig.fused_ops."""
    cpu = fused and device.type == "cpu" and dtype in FUSED_DTYPES and available() is None
    gpu = fused and device.type == "cuda"
    triton_rope = fused and attention == "triton"
    return {
        "attention": attention,
        "rope": "triton, fused into the K/V cache write" if triton_rope else _impl(cpu, False),
        # CpuPagedAttention.forward_qkv: where the kernels read K/V from the cache only
        "qk_norm_rope_kv_write": _qkv_impl(cpu, attention),
        "add_rms_norm": _impl(cpu, gpu),
        "silu_and_mul": _impl(cpu, False),
        "gelu_tanh_and_mul": _impl(cpu, False),
        "linear": _linear_impl(device, fused, dtype),
        "cuda_graphs": "decode, per batch-size bucket" if gpu and attention == "triton" else "off",
    }


def _linear_impl(device: torch.device, packed: bool, dtype: torch.dtype) -> str:
    """The decoder's linears (ModelConfig.pack_weights and plain_weights at their defaults
    on a CPU; `packed`: not --eager)."""
    from kernels import packed_linear

    if device.type != "cpu":
        return "torch"
    if not (packed and dtype in packed_linear.PACKED_DTYPES):
        return "torch eager"
    if not torch.backends.mkldnn.is_available():
        return "torch eager"
    if packed_linear.skinny_available() is not None:
        return "onednn packed"
    skinny, plain = packed_linear.plain_rows(dtype)
    large = "" if plain is None else f", plain GEMM at >= {plain} rows"
    return f"onednn packed; skinny C++ at <= {skinny} rows{large}"


def _qkv_impl(cpu_fused: bool, attention: str) -> str:
    if cpu_fused and attention == "cpu":
        return "cpu C++ (one op from the qkv output)"
    if cpu_fused and attention == "cpu-sdpa":  # SDPA reads the prefills' k and v
        return "cpu C++ in decode-only steps; separate ops with a prefill"
    return "separate ops"


def _impl(cpu_fused: bool, triton: bool) -> str:
    return "cpu C++ (fused)" if cpu_fused else "triton (fused)" if triton else "torch eager"

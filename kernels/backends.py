"""Which paged-attention backend a device and dtype get (`--attention-backend`).

Here, above the backends, so that kernels/attention.py (the interface and the plain-torch
reference every backend imports) imports none of them.
"""

from __future__ import annotations

import torch

from kernels import cpu_attention
from kernels.attention import AttentionBackend, TorchPagedAttention

BACKENDS = ("auto", "torch", "cpu", "cpu-sdpa", "triton", "flashinfer")


def select_backend(
    device: torch.device,
    preferred: str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    block_size: int | None = None,
) -> AttentionBackend:
    """The attention backend for `device`, activation `dtype`, the model's `head_dim` and
    the KV cache's `block_size`. `preferred`: one of BACKENDS; None or "auto" picks Triton
    on a GPU (its kernels build in seconds; FlashInfer's compile with nvcc on first use,
    minutes on a cold cache, and on the first lent H200 Triton's decode was the faster at
    every size measured: docs/hardware.md), FlashInfer where Triton cannot take the block
    size, else torch; FlashInfer by name; on a CPU the C++ kernels where they build
    (kernels/cpu_attention.py: "cpu" = the decode and prefill kernels, "cpu-sdpa" = the
    decode kernel with torch's SDPA for prefills), else plain torch. The torch backend
    runs anywhere and is the reference every other is tested against. The GPU backends
    are imported here, lazily: flashinfer is GPU-only, and triton runs on a CPU only in
    its interpreter."""
    if preferred not in (None, *BACKENDS):
        raise ValueError(f"attention backend {preferred!r} is not one of {', '.join(BACKENDS)}")
    preferred = None if preferred == "auto" else preferred
    if preferred == "torch":
        return TorchPagedAttention()
    if preferred == "triton" or (preferred is None and device.type == "cuda"):
        from kernels import flashinfer_attention, triton_attention

        why = triton_attention.available(device, block_size)
        if why is None:
            return triton_attention.TritonPagedAttention()
        if preferred == "triton":
            raise ValueError(f"attention backend 'triton' cannot run here: {why}")
        if flashinfer_attention.available(device, dtype, head_dim) is None:
            return flashinfer_attention.FlashInferPagedAttention()
        return TorchPagedAttention()
    if preferred == "flashinfer":
        from kernels import flashinfer_attention

        why = flashinfer_attention.available(device, dtype, head_dim)
        if why is not None:
            raise ValueError(f"attention backend 'flashinfer' cannot run here: {why}")
        return flashinfer_attention.FlashInferPagedAttention()
    if device.type == "cpu":
        why = cpu_attention.available()
        prefill_why = None if preferred == "cpu-sdpa" else cpu_attention.prefill_available()
        if why is None and (prefill_why is None or preferred is None):
            use_kernel = preferred != "cpu-sdpa" and prefill_why is None
            return cpu_attention.CpuPagedAttention(prefill_kernel=use_kernel)
        if preferred is not None:
            raise ValueError(
                f"attention backend {preferred!r} cannot run here: {why or prefill_why}"
            )
    elif preferred is not None:
        raise ValueError(f"attention backend {preferred!r} runs on a CPU device, not {device.type}")
    return TorchPagedAttention()


def choose_attention_paths(
    backend: AttentionBackend,
    preferred: str | None,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Under "auto", once the model's head shape is known: a CPU backend's prefills go to
    the C++ prefill kernel or to torch's SDPA, whichever was faster on this CPU in `dtype`
    at this head shape (kernels/calibration.py). A backend asked for by name is kept.
    Either way a CPU backend's decodes take the decode kernel's AMX path where that was
    faster here (`decode_amx_wins`), and its vector path the prefetch that was
    (`decode_spread_wins`)."""
    if not isinstance(backend, cpu_attention.CpuPagedAttention):
        return
    backend.decode_amx = cpu_attention.decode_amx_wins(dtype, num_heads, num_kv_heads, head_dim)
    backend.decode_spread = cpu_attention.decode_spread_wins(
        dtype, num_heads, num_kv_heads, head_dim
    )
    if preferred not in (None, "auto"):
        return
    if backend.prefill_kernel:
        if not cpu_attention.prefill_kernel_wins(dtype, num_heads, num_kv_heads, head_dim):
            backend.use_sdpa_for_prefills()

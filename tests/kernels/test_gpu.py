"""Device checks: run by benchmarks/gpu_check.py on a machine with an NVIDIA GPU. The paged
attention checks on CUDA are the `cuda` cases of test_attention.py, test_triton.py (the
Triton kernels compiled, not interpreted) and test_flashinfer.py."""

from __future__ import annotations

import pytest
import torch


def greedy_tokens(path, random_image, device: str, dtype: str, backend: str | None, **model):
    from tests.helpers import chat, greedy, make_engine

    texts = [(3, "where is the star"), (4, "count the shapes"), (5, "why")]
    requests = [chat([random_image(seed, 70, 40)], text, greedy(16)) for seed, text in texts]
    engine = make_engine(
        path, num_blocks=64, block_size=16, budget=256, max_num_seqs=8,
        device=device, dtype=dtype, attention_backend=backend, **model,
    )  # fmt: skip
    return [out.token_ids for out in engine.generate(requests)], engine


@pytest.mark.gpu
def test_engine_on_cuda_gives_the_cpu_tokens(llava_ov_path, random_image):
    cpu, _ = greedy_tokens(llava_ov_path, random_image, "cpu", "float32", None)
    cuda, _ = greedy_tokens(llava_ov_path, random_image, "cuda", "float32", "torch")
    assert cpu == cuda


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llava_ov_path", "idefics3_path"])
def test_triton_backend_with_cuda_graphs_gives_the_torch_tokens(family, request, random_image):
    """The Triton kernels (compiled), the fused RoPE + K/V write and add + RMSNorm, and the
    decode step replayed from CUDA graphs: token-exact against the torch backend."""
    path = request.getfixturevalue(family)
    reference, _ = greedy_tokens(path, random_image, "cuda", "float32", "torch", fused_ops=False)
    tokens, engine = greedy_tokens(path, random_image, "cuda", "float32", "triton")
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # replayed
    assert tokens == reference
    eager, engine = greedy_tokens(
        path, random_image, "cuda", "float32", "triton", cuda_graphs=False
    )
    assert engine.runner.graphs is None and eager == reference


@pytest.mark.gpu
@pytest.mark.parametrize("family, kv_heads", [("llava_onevision", 2), ("idefics3", 8)])
def test_flashinfer_backend_gives_the_torch_tokens(family, kv_heads, tmp_path, random_image):
    """Head dim 64 (FlashInfer's kernels start there; the shared fixtures have 16):
    8 query heads over 2 (GQA, as LLaVA-OneVision's Qwen2) or 8 KV heads (Idefics3)."""
    from kernels import flashinfer_attention
    from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

    why = flashinfer_attention.available(torch.device("cuda"), torch.float16)
    if why is not None:
        pytest.skip(why)
    path = make_vlm_checkpoint(tmp_path, family, hidden=512, heads=8, kv_heads=kv_heads)
    reference, _ = greedy_tokens(path, random_image, "cuda", "float16", "torch")
    tokens, engine = greedy_tokens(path, random_image, "cuda", "float16", "flashinfer")
    assert engine.runner.backend.name == "flashinfer"
    assert tokens == reference


@pytest.mark.gpu
def test_auto_picks_a_gpu_backend():
    """Triton under auto (no nvcc build on first use); FlashInfer by name, and refused at a
    head dim its kernels do not compile for."""
    from kernels import flashinfer_attention
    from kernels.backends import select_backend

    cuda = torch.device("cuda")
    assert select_backend(cuda, "auto", torch.bfloat16, 128).name == "triton"
    assert select_backend(cuda, "auto", torch.float32).name == "triton"
    assert select_backend(cuda, "auto", torch.bfloat16, 128, 4).name != "triton"
    if flashinfer_attention.available(cuda) is None:
        assert select_backend(cuda, "flashinfer", torch.bfloat16, 128).name == "flashinfer"
        with pytest.raises(ValueError, match="head dims"):
            select_backend(cuda, "flashinfer", torch.bfloat16, 16)

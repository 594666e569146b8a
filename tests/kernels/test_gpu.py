"""Device checks: run by benchmarks/gpu_check.py on a machine with an NVIDIA GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionBatch, TorchPagedAttention


@pytest.mark.gpu
def test_paged_attention_on_cuda_matches_cpu():
    torch.manual_seed(0)
    block, num_blocks, kv_heads, heads, dim = 16, 32, 2, 8, 64
    shapes = [(40, 25), (100, 1), (7, 1), (0, 33)]
    tables, free = [], list(range(num_blocks))
    for cached, new in shapes:
        tables.append([free.pop() for _ in range(-(-(cached + new) // block))])
    total_new = sum(n for _, n in shapes)
    q = torch.randn(total_new, heads, dim)
    k = torch.randn(total_new, kv_heads, dim)
    v = torch.randn(total_new, kv_heads, dim)
    cache = torch.randn(2, num_blocks * block, kv_heads, dim)
    slots = torch.cat(
        [
            torch.tensor([t[p // block] * block + p % block for p in range(c, c + n)])
            for t, (c, n) in zip(tables, shapes, strict=True)
        ]
    )
    batch = AttentionBatch([n for _, n in shapes], [c + n for c, n in shapes], tables, block)
    backend = TorchPagedAttention()
    outs = []
    for device in ("cpu", "cuda"):
        dev = torch.device(device)
        meta = backend.build_metadata(batch, slots, dev)
        out = backend.forward(q.to(dev), k.to(dev), v.to(dev), cache.clone().to(dev), meta, 0.125)
        outs.append(out.cpu())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_engine_on_cuda_gives_the_cpu_tokens(llava_ov_path, random_image):
    from scheduler.config import CacheConfig
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine import Engine
    from vlmserve.processing import Request
    from vlmserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    content = [{"type": "image", "image": random_image(3, 70, 40)},
               {"type": "text", "text": "where is the star"}]  # fmt: skip
    tokens = []
    for device in ("cpu", "cuda"):
        engine = Engine(
            EngineConfig(
                ModelConfig(str(llava_ov_path), device=device, dtype="float32"),
                CacheConfig(num_blocks=64, block_size=16),
            )
        )
        [out] = engine.generate(
            [Request(messages=[{"role": "user", "content": content}], sampling=params)]
        )
        tokens.append(out.token_ids)
    assert tokens[0] == tokens[1]

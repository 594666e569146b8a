"""Device checks: run by benchmarks/gpu_check.py on a machine with an NVIDIA GPU. The paged
attention check on CUDA is the `cuda` case of test_attention.py (the CPU test's helper)."""

from __future__ import annotations

import pytest


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

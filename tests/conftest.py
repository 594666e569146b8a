"""Shared fixtures: tiny random checkpoints in the real HF formats, built once per run."""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which triton reads when its
# language module and each kernel are decorated, i.e. at their first import (transformers'
# model classes import triton): set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from vlmserve.worker.models.random_checkpoint import (  # noqa: E402
    make_gemma3_checkpoint,
    make_text_checkpoint,
    make_vlm_checkpoint,
)


@pytest.fixture(scope="session")
def llava_ov_path(tmp_path_factory):
    """LLaVA-OneVision: SigLIP + Qwen2 with GQA (4 query heads over 2 KV heads)."""
    return make_vlm_checkpoint(tmp_path_factory.mktemp("llava_ov"), "llava_onevision")


@pytest.fixture(scope="session")
def idefics3_path(tmp_path_factory):
    """Idefics3: SigLIP + Llama with MHA (4 query heads, 4 KV heads)."""
    return make_vlm_checkpoint(tmp_path_factory.mktemp("idefics3"), "idefics3", kv_heads=4)


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory):
    """Gemma 3: 12 layers (5 sliding : 1 global, window 64), GQA 4/2, QK-norm, a 2-layer
    SigLIP at 32 px pooled to 16 tokens per image."""
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def gemma3_text_path(tmp_path_factory):
    """Gemma3ForCausalLM with a final logit softcap (the text-only form applies it)."""
    return make_gemma3_checkpoint(
        tmp_path_factory.mktemp("gemma3_text"), text_only=True, final_logit_softcapping=3.0
    )


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def random_image():
    """random_image(seed, width, height): a noisy, never-blank RGB image (Idefics3 drops
    all-zero tiles)."""

    def make(seed: int, width: int, height: int) -> Image.Image:
        rng = np.random.default_rng(seed)
        return Image.fromarray(rng.integers(1, 255, (height, width, 3), dtype=np.uint8))

    return make


@pytest.fixture(scope="session")
def chi_square():
    """chi_square(counts, probs): the p-value of integer token `counts` against `probs`
    (goodness of fit; bins expecting under 5 pooled); 0 when a token of probability 0
    occurred."""
    import torch

    def p_value(counts, probs) -> float:
        counts, probs = counts.double(), probs.double()
        if counts[probs == 0].sum() > 0:
            return 0.0
        expected = probs * counts.sum()
        rare = expected < 5
        counts = torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)])
        expected = torch.cat([expected[~rare], expected[rare].sum(0, keepdim=True)])
        keep = expected > 0
        stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
        dof = int(keep.sum()) - 1
        if dof <= 0:
            return 1.0
        return float(torch.special.gammaincc(torch.tensor(dof / 2.0).double(), stat / 2))

    return p_value


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests skip cleanly without an NVIDIA GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

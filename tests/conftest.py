"""Fixtures every folder may use, and the markers' rules. Imports no torch: the scheduler
and search tests run without it. The torch folders (benchmarks, encoders, kernels,
vlmserve) load tests/fixtures/models.py from their own conftest.py."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="session")
def random_image():
    """random_image(seed, width, height): a noisy, never-blank RGB image (Idefics3 drops
    all-zero tiles)."""

    def make(seed: int, width: int, height: int) -> Image.Image:
        rng = np.random.default_rng(seed)
        return Image.fromarray(rng.integers(1, 255, (height, width, 3), dtype=np.uint8))

    return make


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests skip cleanly without an NVIDIA GPU (torch is asked only
    when such a test was collected)."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in gpu_items:
        item.add_marker(skip)

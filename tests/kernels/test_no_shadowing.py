"""transformers probes for an optional hub package also named `kernels`; ours must not be
mistaken for it, and transformers must keep working beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_transformers_does_not_take_our_kernels_for_the_hub_package():
    code = (
        f"ROOT = {str(ROOT)!r}\n"
        + """
import kernels, kernels.attention
import transformers
from transformers.utils import import_utils
from transformers import LlamaConfig, LlamaForCausalLM
import torch
assert kernels.__file__.startswith(ROOT), kernels.__file__
assert not import_utils.is_kernels_available()
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                     eos_token_id=None))
out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
assert out.shape == (1, 6)
assert kernels.attention.TorchPagedAttention.name == "torch"
print("ok")
"""
    )
    # A fresh interpreter, so that import order and probing start from scratch.
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_our_kernels_import_after_transformers():
    import transformers  # noqa: F401

    import kernels.attention

    assert Path(kernels.attention.__file__).resolve().is_relative_to(ROOT)

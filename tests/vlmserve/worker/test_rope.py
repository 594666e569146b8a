"""Our inverse frequencies against transformers' ROPE_INIT_FUNCTIONS."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.fused_ops import rope_eager as apply_rope
from vlmserve.worker.models.rope import RopeConfig, RotaryEmbedding, rope_config_from_hf

SCALINGS = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
]  # fmt: skip


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_inverse_frequencies_match_transformers(scaling):
    params = {"rope_theta": 50000.0, **scaling}
    hf_config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=2048,
        rope_parameters=params,
    )  # fmt: skip
    fn = ROPE_INIT_FUNCTIONS.get(scaling["rope_type"])
    if fn is None:  # default lives on the rotary class in transformers 5
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, expected_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, expected_scale = fn(hf_config, "cpu")
    ours = RotaryEmbedding(rope_config_from_hf(hf_config.to_dict(), head_dim=32))
    ours.cos_sin(torch.arange(3), torch.float32)
    torch.testing.assert_close(ours._inv_freq, expected.float())
    assert ours.attention_scaling == pytest.approx(expected_scale)


def test_legacy_rope_scaling_layout_is_read():
    cfg = rope_config_from_hf(
        {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}, head_dim=16
    )
    assert (cfg.rope_type, cfg.theta, cfg.params["factor"]) == ("linear", 1e6, 2.0)


def test_unknown_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        RopeConfig(head_dim=16, rope_type="dynamic")


def test_rotation_preserves_norm_and_position_zero_is_identity():
    rope = RotaryEmbedding(RopeConfig(head_dim=8))
    x = torch.randn(3, 2, 8)
    cos, sin = rope.cos_sin(torch.tensor([0, 5, 100]), torch.float32)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))

"""`ModelConfig.pack_weights` reaches the vision encoder: on CPU float32 the runner packs
the tower's and the projector's linears next to the decoder's (and leaves them plain when
the flag is off). The packed tower's tokens are checked in test_engine against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.packed_linear import PackedLinear
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.worker.runner import ModelRunner


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("pack_weights", [True, False])
def test_runner_packs_the_vision_encoder_with_the_decoder(llava_ov_path, pack_weights):
    config = ModelConfig(str(llava_ov_path), device="cpu", pack_weights=pack_weights)
    model = ModelRunner(EngineConfig(config)).model
    kind = PackedLinear if pack_weights else nn.Linear
    block = model.vision.tower.vit.blocks[0]
    layers = [block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2]
    layers += [model.vision.projector.linear_1, model.decoder.layers[0].mlp.down_proj]
    assert all(isinstance(layer, kind) for layer in layers)
    assert model.vision.tower.fused


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("model", ["llama_path", "gemma3_text_path"])  # untied, tied head
def test_the_runner_takes_the_calibrated_cpu_choices(model, request, monkeypatch):
    """The runner asks the calibration at the model's own shapes and runs what it chose:
    the LM head's rows and GEMM ("oneDNN's packed GEMM from 2 rows", here forced), and
    the prefill attention path (SDPA where the C++ kernel lost)."""
    from kernels import cpu_attention, lm_head, packed_linear
    from kernels.calibration import HeadChoice

    if packed_linear.skinny_available() or cpu_attention.prefill_available():
        pytest.skip("the CPU kernels did not build here")
    asked = {}

    def head_choice(dtype, hidden, vocab):
        asked["head"] = (dtype, hidden, vocab)
        return HeadChoice(1, "packed")

    def prefill_kernel_wins(dtype, heads, kv_heads, head_dim):
        asked["prefill"] = (dtype, heads, kv_heads, head_dim)
        return False

    monkeypatch.setattr(lm_head, "head_choice", head_choice)
    monkeypatch.setattr(cpu_attention, "prefill_kernel_wins", prefill_kernel_wins)
    runner = ModelRunner(EngineConfig(ModelConfig(str(request.getfixturevalue(model)), "cpu")))
    decoder, cfg = runner.model.decoder, runner.model.decoder.cfg
    assert asked["head"] == (torch.float32, cfg.hidden_size, cfg.vocab_size)
    assert asked["prefill"] == (torch.float32, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert runner.backend.name == "cpu-sdpa"
    head = decoder.lm_head
    assert isinstance(head, lm_head.LogitsHead) and head.choice == HeadChoice(1, "packed")
    calls = []
    packed = packed_linear.PackedLinear.forward_packed
    monkeypatch.setattr(
        packed_linear.PackedLinear, "forward_packed", lambda s, x: calls.append(1) or packed(s, x)
    )
    hidden = torch.randn(5, cfg.hidden_size)
    logits = decoder.compute_logits(hidden)
    assert calls == [1] and logits.shape == (5, cfg.vocab_size)
    weight = decoder.embed_tokens.weight if cfg.tie_word_embeddings else head.plain
    expected = F.linear(hidden, weight)
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        expected = torch.tanh(expected / cap) * cap
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)

"""`ModelConfig.pack_weights` reaches the vision encoder: on CPU float32 the runner packs
the tower's and the projector's linears next to the decoder's (and leaves them plain when
the flag is off). The packed tower's tokens are checked in test_engine against transformers."""

from __future__ import annotations

import pytest
import torch
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

"""Prepacked (oneDNN) linear layers against the plain `nn.Linear` they replace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlmserve.models.decoder import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("rows", [1, 7, 64, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_pack_linears_replaces_cpu_float32_layers_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), nn.ReLU()))
    model.append(nn.Linear(4, 4).to(torch.float64))
    x = torch.randn(5, 8)
    expected = model[1](model[0](x))
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert isinstance(model[2], nn.Linear)  # float64: left alone
    torch.testing.assert_close(model[1](model[0](x)), expected, rtol=1e-5, atol=1e-5)

"""Prepacked (oneDNN) linear layers and their fused epilogues against the plain ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.packed_linear import PackedLinear, linear_act, linear_add, pack_linears

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


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("packed", [False, True])
def test_linear_act_matches_gelu_of_linear(act, packed):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    x = torch.randn(3, 37, 48)  # leading dims pass through
    approximate = "tanh" if act == "gelu_tanh" else "none"
    expected = F.gelu(linear(x), approximate=approximate)
    layer = PackedLinear(linear) if packed else linear
    torch.testing.assert_close(linear_act(layer, x, act), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_linear_add_adds_the_residual_and_leaves_it_alone(packed):
    torch.manual_seed(1)
    linear = nn.Linear(48, 32)
    x, residual = torch.randn(50, 48), torch.randn(50, 32)
    before = residual.clone()
    layer = PackedLinear(linear) if packed else linear
    expected = residual + linear(x)
    torch.testing.assert_close(linear_add(layer, x, residual), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(residual, before)

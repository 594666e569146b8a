"""Prepacked (oneDNN) linear layers and their fused epilogues against the plain ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.packed_linear import (
    PackedLinear,
    linear_act,
    linear_add,
    pack_linears,
    skinny_available,
    skinny_linear,
)

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


# -- the skinny kernel and the plain-weight paths ---------------------------------------


@pytest.fixture
def needs_skinny():
    """The kernel builds on first use: when a test needs it, never at collection."""
    if (why := skinny_available()) is not None:
        pytest.skip(f"skinny kernel unavailable: {why}")


@pytest.mark.usefixtures("needs_skinny")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize(("in_features", "out_features"), [(768, 130), (13, 7), (100, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_a_float64_reference(rows, in_features, out_features, bias):
    # Row counts across the 4-row tiles and their remainders; widths off the vector
    # lanes (masked tails) and output counts off the weight-row groups.
    torch.manual_seed(rows * 1000 + in_features + out_features)
    weight = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, in_features)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    got = skinny_linear(x, weight, b)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    # float32 sums of in_features products: errors grow like sqrt(in_features) ulps
    atol = 5e-6 * in_features**0.5
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=atol)


@pytest.mark.usefixtures("needs_skinny")
def test_skinny_linear_takes_strided_rows_and_leading_dims():
    torch.manual_seed(2)
    weight = torch.randn(40, 64)
    wide = torch.randn(6, 100)
    x = wide[:, 10:74]  # rows 100 floats apart
    torch.testing.assert_close(skinny_linear(x, weight, None), x @ weight.T, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 64)
    torch.testing.assert_close(skinny_linear(x3, weight, None), x3 @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("needs_skinny")
def test_skinny_linear_refuses_what_it_cannot_read():
    weight = torch.randn(8, 16)
    out = torch.empty(2, 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.vlmserve_skinny.linear(out, torch.randn(2, 16), torch.randn(8, 20)[:, :16], None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.vlmserve_skinny.linear(out, torch.randn(2, 16).double(), weight, None)


@pytest.mark.usefixtures("needs_skinny")
@pytest.mark.parametrize("rows", [1, 4, 16, 17, 1536])
def test_packed_linear_with_plain_weights_matches_linear_on_every_path(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200)
    layer = PackedLinear(linear, plain=True)
    # the skinny kernel to 16 rows, MKL from 1,536, whatever this CPU's calibration chose
    layer.skinny_rows, layer.plain_rows = 16, 1536
    assert layer.plain is not None and torch.equal(layer.plain, linear.weight)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)


def test_pack_linears_keeps_plain_weights_only_when_asked():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    assert pack_linears(model) == 2
    assert model[0].plain is None and model[1][0].plain is None
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    pack_linears(model, plain=True)
    kept = skinny_available() is None
    assert (model[0].plain is not None) == kept and (model[1][0].plain is not None) == kept


def test_the_mkl_calibration_measures_both_paths_and_stops_where_onednn_wins(monkeypatch):
    from kernels import packed_linear

    monkeypatch.setattr(packed_linear, "MKL_ROWS", (64, 32))
    monkeypatch.setattr(packed_linear, "MKL_DIM", 128)
    seconds = packed_linear._measure_mkl()
    assert 1 <= len(seconds) <= 2 and seconds[0]["rows"] == 64
    assert all(r["onednn"] > 0 and r["mkl"] > 0 for r in seconds)
    if len(seconds) == 1:  # stopped: oneDNN won at 64 rows
        assert seconds[0]["onednn"] < packed_linear.calibration.MARGIN * seconds[0]["mkl"]

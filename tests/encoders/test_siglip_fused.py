"""The fused SigLIP forward against transformers' SiglipVisionModel on tiny random configs,
at the head shapes served (head_dim 64: SigLIP-base widths, the vs_vllm workload; 72:
so400m, real LLaVA-OneVision / Idefics3), with plain and prepacked linears.

With plain linears the fused path meets test_vision's tolerance. Packed (oneDNN) GEMMs sum
in another order: they differ from transformers by a few float32 roundings (~2e-6 at
|x| ~ 4), so they are held to test_packed_linear's tolerance here, and to the accuracy
that matters: no further from a float64 forward than transformers' own float32 is."""

from __future__ import annotations

import pytest
import torch
from transformers import SiglipVisionConfig, SiglipVisionModel

from encoders.siglip import SiglipConfig, SiglipTower, load_siglip_tower
from encoders.siglip_fused import default_tiles_per_chunk
from kernels.packed_linear import PackedLinear

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
HEAD_DIMS = [64, 72]


def close(actual: torch.Tensor, expected: torch.Tensor, packed: bool = False) -> None:
    atol = 1e-5 if packed else 1e-6  # test_packed_linear's / test_vision's
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol)


def hf_tower(head_dim: int, hidden_act: str = "gelu_pytorch_tanh") -> SiglipVisionModel:
    torch.manual_seed(head_dim)
    # 4 x 4 patches of 8 pixels per tile; the conv drops a 4-pixel margin, as so400m's does
    config = SiglipVisionConfig(
        hidden_size=2 * head_dim, intermediate_size=4 * head_dim, num_hidden_layers=3,
        num_attention_heads=2, image_size=36, patch_size=8, hidden_act=hidden_act,
    )  # fmt: skip
    return SiglipVisionModel(config).eval()


def our_tower(hf: SiglipVisionModel, post_norm: bool, packed: bool, **kwargs) -> SiglipTower:
    config = SiglipConfig.from_hf(hf.config.to_dict(), {})
    tower = SiglipTower(config, post_norm=post_norm, **kwargs)
    load_siglip_tower(tower, hf.state_dict(), prefix="")
    if packed:
        assert tower.pack() == 4 * config.num_hidden_layers
        assert isinstance(tower.vit.blocks[0].mlp.fc1, PackedLinear)
    return tower.eval()


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("tiles_per_chunk", [None, 2])  # 2: chunks of 2, 2 and 1 tiles
def test_fused_tower_matches_transformers(head_dim, packed, tiles_per_chunk):
    hf = hf_tower(head_dim)
    pixel_values = torch.randn(5, 3, 36, 36)
    with torch.no_grad():
        out = hf(pixel_values, output_hidden_states=True)
        tower = our_tower(hf, post_norm=True, packed=packed, tiles_per_chunk=tiles_per_chunk)
        close(tower(pixel_values), out.last_hidden_state, packed)
        tower = our_tower(hf, post_norm=False, packed=packed, tiles_per_chunk=tiles_per_chunk)
        layers = [-1, 0, 2, -2]  # LLaVA-OneVision may ask for several, the embeddings too
        for got, i in zip(tower.hidden_states(pixel_values, layers), layers, strict=True):
            close(got, out.hidden_states[i], packed)


@needs_onednn
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_packed_tower_is_as_accurate_as_transformers(head_dim):
    hf = hf_tower(head_dim)
    pixel_values = torch.randn(5, 3, 36, 36)
    with torch.no_grad():
        truth = our_tower(hf, post_norm=True, packed=False).double()(pixel_values.double())
        hf_error = (hf(pixel_values).last_hidden_state - truth).abs()
        packed = our_tower(hf, post_norm=True, packed=True)(pixel_values)
    error = (packed - truth).abs()
    assert error.max() <= 1.5 * hf_error.max(), (error.max(), hf_error.max())
    assert error.square().mean() <= 1.2 * hf_error.square().mean()


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_onednn)])
def test_fused_tower_with_exact_gelu(packed):
    hf = hf_tower(64, hidden_act="gelu")
    pixel_values = torch.randn(2, 3, 36, 36)
    with torch.no_grad():
        tower = our_tower(hf, post_norm=True, packed=packed)
        close(tower(pixel_values), hf(pixel_values).last_hidden_state, packed)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fused_equals_timm_reference_path(head_dim):
    # the reference path stays reachable (fused=False) and agrees with the fused one,
    # also when the linears are packed (timm's own forward then calls PackedLinear)
    hf = hf_tower(head_dim)
    pixel_values = torch.randn(3, 3, 36, 36)
    with torch.no_grad():
        tower = our_tower(hf, post_norm=False, packed=False)
        fused = tower.hidden_states(pixel_values, [-1])[0]
        tower.fused = False
        close(tower.hidden_states(pixel_values, [-1])[0], fused)
        if torch.backends.mkldnn.is_available():
            tower.pack()
            close(tower.hidden_states(pixel_values, [-1])[0], fused, packed=True)


def test_pack_keeps_float64_towers_plain():
    hf = hf_tower(64)
    tower = our_tower(hf, post_norm=True, packed=False).double()
    assert tower.pack() == 0
    pixel_values = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    with torch.no_grad():
        expected = hf.double()(pixel_values).last_hidden_state
        torch.testing.assert_close(tower(pixel_values), expected)


def test_default_chunking_is_per_tile_on_one_cpu_thread_only():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert default_tiles_per_chunk(torch.device("cpu"), 7) == 1
        torch.set_num_threads(2)
        assert default_tiles_per_chunk(torch.device("cpu"), 7) == 7
        assert default_tiles_per_chunk(torch.device("meta"), 7) == 7  # a GPU: every tile
    finally:
        torch.set_num_threads(threads)


@needs_onednn
@pytest.mark.parametrize("wins", [True, False])
def test_packing_settles_the_towers_attention_path_as_calibrated(monkeypatch, wins):
    """`pack` asks the calibration once at the tower's shape (dtype, heads, head dim,
    patches) and every block's attention then takes that path: the C++ kernel or SDPA."""
    from kernels import cpu_attention

    if cpu_attention.prefill_available() is not None:
        pytest.skip("the prefill kernel did not build here")
    asked, calls = [], []
    monkeypatch.setattr(
        cpu_attention, "tile_kernel_wins", lambda *shape: asked.append(shape) or wins
    )
    tile_attention = cpu_attention.tile_attention
    monkeypatch.setattr(
        cpu_attention, "tile_attention", lambda *a: calls.append(1) or tile_attention(*a)
    )
    hf = hf_tower(64)
    tower = our_tower(hf, post_norm=True, packed=True)
    assert asked == [(torch.float32, 2, 64, 16)] and tower.tile_kernel is wins
    pixel_values = torch.randn(2, 3, 36, 36)
    with torch.no_grad():
        out = tower(pixel_values)
        expected = hf(pixel_values).last_hidden_state
    assert len(calls) == (3 if wins else 0) and len(asked) == 1  # one per block
    close(out, expected, packed=True)

"""Quantized weights (kernels/quant_linear.py, csrc/quant_linear_cpu.cpp) against the `gguf`
package's own decoders and a float64 matmul on the dequantized weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels import quant_linear as ql
from kernels.quant_linear import ISA, QuantLinear, QuantWeight
from vlmserve.worker.models.quantized import QuantEmbedding, quantize_int8

Q = GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K]
REAL = Path.home() / ".cache" / "vlmserve" / "real" / "gemma-3-270m-q4_k_m.gguf"
# Relative error (Frobenius norm of the difference over the reference's) measured at these
# shapes, every block type, rows 1-300: the int-dot path (activations quantized to int8 per
# 32 or 256 values) at most 9.0e-3, float32 or bfloat16 x alike (x is rounded before the
# reference sees it); the tile path 2.4e-7 in float32, 2.9e-3 in bfloat16 (bfloat16-rounded
# weights, bfloat16 out). Bounds with margin:
INT_DOT_BOUND = 2e-2
TILE_BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def needs_kernel():
    """Built on first use, when a test needs it, never at collection."""
    if (why := ql.kernel_available()) is not None:
        pytest.skip(f"quantized kernels unavailable: {why}")


def random_blocks(qtype: int, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """gguf's own quantization of random weights where it can quantize that type;
    otherwise random bytes with finite float16 scales of varied magnitude."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0):
        dense = rng.standard_normal((rows, in_features)).astype(np.float32)
        dense *= rng.uniform(0.01, 3, (rows, 1)).astype(np.float32)
        return quantize(dense, Q(qtype))
    block, block_bytes = GGML_QUANT_SIZES[Q(qtype)]
    raw = rng.integers(0, 256, (rows, in_features // block, block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, in_features // block, 2)) * 1e-2).astype(np.float16)
    if qtype == Q.Q6_K:
        raw[..., 208:210] = scales[..., :1].view(np.uint8)
    else:  # Q4_K: d and dmin
        raw[..., 0:4] = scales.view(np.uint8).reshape(rows, -1, 4)
    return raw.reshape(rows, -1)


def weight(qtype: int, rows: int, in_features: int, seed: int = 0) -> QuantWeight:
    raw = random_blocks(qtype, rows, in_features, seed)
    return QuantWeight.from_gguf(raw, int(qtype), (rows, in_features))


def reference(w: QuantWeight) -> torch.Tensor:
    """gguf's numpy decoder, float32 [out, in]."""
    return torch.from_numpy(dequantize(w.blocks.numpy(), Q(w.qtype)).copy())


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_identical_to_gguf(qtype):
    w = weight(qtype, 37, 512, seed=int(qtype))
    ref = reference(w)
    assert torch.equal(w.dequantize().view(torch.int32), ref.view(torch.int32))
    assert torch.equal(w.dequantize(dtype=torch.bfloat16), ref.to(torch.bfloat16))
    rows = torch.tensor([36, 0, 5, 5, 17])
    assert torch.equal(w.dequantize(rows).view(torch.int32), ref[rows].view(torch.int32))
    w.permute_rows(torch.arange(36, -1, -1))
    assert torch.equal(w.dequantize(), ref.flip(0))


@pytest.mark.skipif(not REAL.exists(), reason="the real checkpoint is not fetched")
def test_dequantize_real_tensors_bit_identical():
    from vlmserve.worker.models.gguf_file import GGUFFile

    gguf_file = GGUFFile(REAL)
    seen = set()
    for info in gguf_file.tensors:
        if info.qtype not in ql.SUPPORTED_QTYPES or info.qtype in seen or len(info.shape) != 2:
            continue
        seen.add(info.qtype)
        raw = gguf_file.raw(info)[:2048]  # the 262k-row embedding: its first rows
        w = QuantWeight.from_gguf(raw, info.qtype, (raw.shape[0], info.shape[1]))
        expected = dequantize(np.asarray(raw), Q(info.qtype))
        assert np.array_equal(w.dequantize().numpy().view(np.int32), expected.view(np.int32))
    assert seen == {int(t) for t in (Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["int_dot", "tile"])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_against_float64_matmul(qtype, rows, path, dtype):
    w = weight(qtype, 96, 512, seed=rows)
    layer = QuantLinear([w])
    layer.path = path
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    ref = x.double() @ reference(w).double().T
    bound = INT_DOT_BOUND if path == "int_dot" else TILE_BOUND[dtype]
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    assert rel_error(out, ref) < bound
    out32 = layer.forward_float(x)
    assert out32.dtype == torch.float32
    assert rel_error(out32, ref) < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["int_dot", "tile"])
def test_mixed_parts_with_bias_and_leading_dims(path, dtype):
    shapes = [(Q.Q5_0, 64), (Q.Q5_0, 24), (Q.Q8_0, 32), (Q.Q4_K, 48), (Q.Q6_K, 16), (Q.Q4_0, 8)]
    parts = [weight(qtype, rows, 512, seed) for seed, (qtype, rows) in enumerate(shapes, 1)]
    bias = (torch.randn(192) * 10).to(dtype)  # about the outputs' size: a lost bias shows
    layer = QuantLinear(parts, bias)
    layer.path = path
    assert (layer.in_features, layer.out_features) == (512, 192)
    assert len(layer.parts) == 5  # the two Q5_0 neighbours: one kernel call
    x = torch.randn(2, 3, 512).to(dtype)
    full = torch.cat([reference(p) for p in parts]).double()
    ref = x.double() @ full.T + bias.double()
    out = layer.forward_float(x)
    assert out.shape == (2, 3, 192)
    assert rel_error(out, ref) < (INT_DOT_BOUND if path == "int_dot" else TILE_BOUND[dtype])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_instruction_set_gives_the_same_sums(qtype):
    """The int-dot paths (scalar, AVX2, the VNNI ones where built) compute the same integer
    sums; only float32 accumulation order differs."""
    w = weight(qtype, 40, 1024, seed=7)
    layer = QuantLinear([w])
    layer.path = "int_dot"
    x = torch.randn(5, 1024)
    ref = x.double() @ reference(w).double().T
    outs = {}
    for name, isa in ISA.items():
        if not torch.ops.vlmserve_quant.has_isa(isa):
            continue
        layer.isa = isa
        outs[name] = layer(x)
        assert rel_error(outs[name], ref) < INT_DOT_BOUND, name
    scalar = outs.pop("scalar")
    assert outs or ql.best_isa() == ISA["scalar"]
    for name, out in outs.items():  # measured: within 7e-7 of the largest output
        assert (out - scalar).abs().max() <= 1e-5 * scalar.abs().max(), name


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_odd_number_of_blocks(qtype, rows):
    """7 blocks a row: the AVX-512 paths take them two or four at a time, the last ones
    alone or padded; 23 weight rows: one row of x takes Q4_0 / Q5_0 four weight rows a
    pass, the last ones one by one."""
    w = weight(qtype, 23, 224, seed=rows)
    layer = QuantLinear([w])
    layer.path = "int_dot"
    x = torch.randn(rows, 224, generator=torch.Generator().manual_seed(rows))
    assert rel_error(layer(x), x.double() @ reference(w).double().T) < INT_DOT_BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quants_with_a_weight_row_remainder(qtype, rows, dtype):
    """On AVX-512 the K-quants take four weight rows a pass over up to four rows of x and
    the weight rows left over (23 rows, on any thread count) one at a time; 3 superblocks."""
    w = weight(qtype, 23, 768, seed=3)
    layer = QuantLinear([w])
    layer.path = "int_dot"
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert rel_error(layer.forward_float(x), x.double() @ reference(w).double().T) < INT_DOT_BOUND


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_gets_the_same_sums_alone_or_among_others(qtype):
    """A decode's row and its drafts' verification rows (2-5 rows) run the arithmetic the
    row alone runs, bit for bit: speculation does not change a quantized model's logits."""
    w = weight(qtype, 46, 768, seed=11)
    layer = QuantLinear([w])
    layer.path = "int_dot"
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(11))
    alone = torch.cat([layer.forward_float(x[i : i + 1]) for i in range(9)])
    for rows in (2, 3, 4, 5, 9):
        assert torch.equal(layer.forward_float(x[:rows]), alone[:rows]), rows


def test_auto_path_follows_the_calibrated_rows():
    w = weight(Q.Q8_0, 64, 256)
    layer = QuantLinear([w])
    layer._max_rows[torch.float32] = [2]
    forced = {}
    for path in ("int_dot", "tile"):
        layer.path = path
        forced[path] = (layer(torch.ones(2, 256) / 3), layer(torch.ones(3, 256) / 3))
    layer.path = "auto"
    assert torch.equal(layer(torch.ones(2, 256) / 3), forced["int_dot"][0])
    assert torch.equal(layer(torch.ones(3, 256) / 3), forced["tile"][1])
    assert not torch.equal(forced["int_dot"][0], forced["tile"][0])  # the check can tell


def test_auto_path_takes_amx_between_the_two_crossovers():
    if not ql.amx_available():
        pytest.skip("no AMX tiles here")
    layer = QuantLinear([weight(Q.Q5_0, 40, 1024)])
    layer._max_rows[torch.bfloat16], layer._amx_rows[torch.bfloat16] = [2], [3]
    xs = {rows: torch.randn(rows, 1024).to(torch.bfloat16) for rows in (2, 3, 4)}
    forced = {}
    for path in ("int_dot", "amx", "tile"):
        layer.path = path
        forced[path] = {rows: layer.forward_float(x) for rows, x in xs.items()}
    layer.path = "auto"
    for rows, path in ((2, "int_dot"), (3, "amx"), (4, "tile")):
        assert torch.equal(layer.forward_float(xs[rows]), forced[path][rows]), (rows, path)
    for rows in (3, 4):  # the check can tell (float32 sums, added in other orders)
        assert not torch.equal(forced["amx"][rows], forced["tile"][rows])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_amx_path_is_the_bfloat16_weights_matmul(qtype):
    """AMX (bfloat16 x): the weight dequantized to bfloat16 as `dequantize` rounds it, float32
    sums (float32 out: the bias added, never rounded; bfloat16 out: that rounded); 23 weight
    rows (a part-filled tile of 16), 70 rows of x (a second pass, a part-filled tile), a
    strided output (a part of a fused layer)."""
    if not ql.amx_available():
        pytest.skip("no AMX tiles here")
    w, other = weight(qtype, 23, 512, seed=5), weight(Q.Q8_0, 8, 512, seed=6)
    bias = (torch.randn(31) * 10).to(torch.bfloat16)
    layer = QuantLinear([w, other], bias)
    layer.path = "amx"
    for rows in (1, 17, 70):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        x = x.to(torch.bfloat16)
        full = torch.cat([p.dequantize(dtype=torch.bfloat16) for p in (w, other)]).double()
        ref = x.double() @ full.T + bias.double()
        out = layer.forward_float(x)
        assert rel_error(out, ref) < 1e-6  # measured: at most 1.6e-7
        assert torch.equal(layer(x), out.to(torch.bfloat16))


def test_amx_argmax_is_torch_argmax_of_the_amx_sums():
    """Greedy tokens straight from the AMX path: torch.argmax's pick (the first of equal
    maxima, the first NaN) over 2 threads' tiles, rows of x in 2 passes; tied rows: weight
    row 30 a copy of 5, and 3 of 40 (later, larger columns in other threads' tiles); a NaN
    scale in row 33 (in a second weight)."""
    if not ql.amx_available():
        pytest.skip("no AMX tiles here")
    w = weight(Q.Q8_0, 600, 512, seed=8)
    w.blocks[30], w.blocks[40] = w.blocks[5], w.blocks[3]
    nan = QuantWeight(w.blocks.clone(), w.qtype, 512)
    nan.blocks[33, :2] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)  # float16 NaN
    for weights in (w, nan):
        layer = QuantLinear([weights])
        layer.path = "amx"
        for rows in (1, 17, 70):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            x = x.to(torch.bfloat16)
            x[0] = 0  # every sum 0 (NaN in the NaN row): the first column, or the NaN's
            ids = layer.argmax(x)
            assert torch.equal(ids, torch.argmax(layer.forward_float(x), dim=-1))
        assert ids[0] == (33 if weights is nan else 0)
    layer.path = "int_dot"
    assert layer.argmax(x) is None  # not the AMX path: the caller takes the logits


def test_describe_names_types_bits_and_crossover(monkeypatch):
    rows = {torch.bfloat16: 16, torch.float32: 32}  # the engine's dtype's crossover is shown
    monkeypatch.setattr(ql, "int_dot_max_rows", lambda qtype, dtype, *args: rows[dtype])
    layer = QuantLinear([weight(Q.Q5_0, 8, 256), weight(Q.Q8_0, 8, 256)])
    text = layer.describe()
    assert text.startswith("Q5_0+Q8_0 7 bits/weight") and "up to 16 rows" in text
    assert "(calibrated, bfloat16)" in text
    text = layer.describe(torch.float32)
    assert "up to 32 rows" in text and "(calibrated, float32)" in text


@pytest.mark.slow
def test_calibration_measures_and_caches(monkeypatch, tmp_path):
    monkeypatch.setattr(ql.calibration, "CACHE_DIR", tmp_path)
    rows = ql.int_dot_max_rows(int(Q.Q4_K), torch.bfloat16, 512, 256)
    assert rows in (0, *ql.LADDER)
    stored = ql.calibration.report()["choices"]
    assert stored["quant_int_dot_max_rows/Q4_K/bfloat16/512x256"]["choice"] == rows


def test_quantize_int8_is_gguf_q8_0_and_round_trips():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(50, 320, generator=gen) * torch.rand(50, 1, generator=gen) * 4
    w[3, :32] = 0  # an all-zero block: scale 0
    w[4, :32] = 0.5  # scale 1 (amax 127, below): values at exactly k + 1/2, rounded away from 0
    w[4, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 6.5, -126.5])
    q = quantize_int8(w)
    assert q.qtype == Q.Q8_0 and (q.out_features, q.in_features) == (50, 320)
    assert np.array_equal(q.blocks.numpy(), quantize(w.numpy(), Q.Q8_0))
    blockmax = w.reshape(50, 10, 32).abs().amax(-1, keepdim=True)
    err = (q.dequantize() - w).abs().reshape(50, 10, 32)
    assert (err <= 0.57 * blockmax / 127 + 1e-12).all()  # half a step, plus the f16 scale
    bf = quantize_int8(w.to(torch.bfloat16))
    assert np.array_equal(bf.blocks.numpy(), quantize(w.to(torch.bfloat16).float().numpy(), Q.Q8_0))


def test_unsupported_type_is_refused_naming_the_supported():
    raw = np.zeros((4, 176), dtype=np.uint8)  # Q5_K: 176 bytes a 256-block
    with pytest.raises(ValueError, match="Q5_K.*supported: Q4_0, Q4_K, Q5_0, Q6_K, Q8_0"):
        QuantWeight.from_gguf(raw, int(Q.Q5_K), (4, 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_decodes_the_asked_rows(dtype):
    w = weight(Q.Q8_0, 100, 256)
    emb = QuantEmbedding(w, dtype)
    ids = torch.tensor([[3, 99, 0], [3, 4, 5]])
    out = emb(ids)
    assert out.shape == (2, 3, 256) and out.dtype == dtype
    assert torch.equal(out, reference(w)[ids].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0], ids=lambda t: t.name)
def test_packed_blocks_run_every_path_as_stored(qtype, dtype):
    """Q8_0 / Q5_0 repacked 16 rows at a time (53 rows: 3 tiles and 5 rows as stored): the
    same bytes back on unpacking, dequantization and embedding rows bit for bit, the int-dot
    sums within float32 rounding of the stored layout's on every instruction set (the tile
    kernel on AVX-512 VNNI), a row's sums alone as among 19 rows, the tile path equal."""
    if ql.best_isa() != ISA["avx512_vnni"] or not torch.ops.vlmserve_quant.packable(qtype):
        pytest.skip(f"no packed {qtype.name} kernel in this build")
    w = weight(qtype, 53, 640, seed=5)
    stored = QuantWeight(w.blocks.clone(), w.qtype, w.in_features)
    ref = reference(stored)
    x = torch.randn(19, 640, generator=torch.Generator().manual_seed(5)).to(dtype)
    layers = {"stored": QuantLinear([stored]), "packed": QuantLinear([w])}
    w.pack(force=True)
    assert w.tiled and not torch.equal(w.blocks, stored.blocks)
    assert torch.equal(w.dequantize(), ref)
    rows = torch.tensor([52, 0, 17, 47, 48])
    assert torch.equal(QuantEmbedding(w, dtype)(rows), ref[rows].to(dtype))
    for isa in ISA.values():
        if not torch.ops.vlmserve_quant.has_isa(isa):
            continue
        outs = {}
        for name, layer in layers.items():
            layer.isa, layer.path = isa, "int_dot"
            outs[name] = layer.forward_float(x)
        scale = outs["stored"].abs().max()
        assert (outs["packed"] - outs["stored"]).abs().max() <= 1e-5 * scale, isa
    packed = layers["packed"]
    packed.isa = None
    alone = torch.cat([packed.forward_float(x[i : i + 1]) for i in range(19)])
    assert torch.equal(packed.forward_float(x), alone)
    for layer in layers.values():
        layer.path = "tile"
    assert torch.equal(layers["packed"].forward_float(x), layers["stored"].forward_float(x))
    w.unpack()
    assert not w.tiled and torch.equal(w.blocks, stored.blocks)


def test_pack_follows_the_calibrated_choice(monkeypatch):
    """`pack` repacks where `pack_chosen` chose it (calibrated), never other block types."""
    if ql.best_isa() != ISA["avx512_vnni"]:
        pytest.skip("the packed layout is for the AVX-512 VNNI kernel")
    for chosen in (False, True):
        monkeypatch.setattr(ql, "pack_chosen", lambda qtype, k, chosen=chosen: chosen)
        w, q4 = weight(Q.Q8_0, 32, 256), weight(Q.Q4_0, 32, 256)
        w.pack(), q4.pack()
        assert (w.tiled, q4.tiled) == (chosen, False)

"""The LM head's calibrated paths (kernels/lm_head.py): the rules that choose them from
measurements, the head taking the stored choice, each path against float64, and greedy
tokens straight from the AMX tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import calibration, lm_head, packed_linear
from kernels.calibration import HeadChoice
from tests.kernels.choices.calibration_cache import (
    BF16,
    count_paths,
    needs_onednn,
    needs_packable,
    store,
)


def ladder(*rows_fast_slow, fast="skinny", slow="onednn"):
    return [{"rows": r, fast: a, slow: b} for r, a, b in rows_fast_slow]


def test_the_lm_head_picks_the_skinny_kernel_then_the_faster_gemm():
    def head(*records):  # (rows, skinny, packed, plain) each
        keys = ("rows", "skinny", "packed", "plain")
        return calibration.decide_head([dict(zip(keys, r, strict=True)) for r in records])

    # Zen 5: the skinny kernel to 256 rows; the two GEMMs level
    assert head((1, 1, 2, 2), (64, 5, 9, 9), (256, 20, 30, 29)) == HeadChoice(256, "plain")
    # AMX: oneDNN's packed GEMM several times the skinny kernel from 16 rows
    amx = head((1, 1, 1.5, 3), (16, 4, 1.2, 3), (64, 16, 2, 6), (256, 60, 6, 20))
    assert amx == HeadChoice(1, "packed")
    # packed ahead, but within the margin: the plain weight (no second copy)
    assert head((1, 1, 2, 2), (256, 9, 1.0, 1.05)) == HeadChoice(1, "plain")
    # oneDNN takes no such weight here (bfloat16 on an AVX2 CPU): the skinny kernel, then plain
    keys = ("rows", "skinny", "plain")
    no_onednn = [dict(zip(keys, r, strict=True)) for r in ((1, 1, 3), (16, 4, 3), (64, 16, 6))]
    assert calibration.decide_head(no_onednn) == HeadChoice(1, "plain")
    # Zen 4 (AVX-512 BF16, no AMX; one 32 MB slice of the 262k head, ms): the packed GEMM
    # 4.6x the plain one at 16 rows, level at 256: packed up to 64 rows, plain above
    zen4 = ((1, 4.9, 6.5, 8.0), (4, 1.9, 3.7, 8.0), (16, 4.4, 2.4, 11.1),
            (64, 17.7, 17.4, 24.2), (256, 59.8, 56.2, 55.9))  # fmt: skip
    assert head(*zen4) == HeadChoice(4, "packed", 65)
    # the plain GEMM ahead only at a small size: the packed one throughout costs less
    assert head((1, 1, 2, 2), (16, 9, 3.0, 2.0), (256, 90, 10, 30)) == HeadChoice(1, "packed")


def test_greedy_takes_the_fused_argmax_over_the_rows_it_wins():
    def greedy(*records):  # (rows, logits, fused) each
        return calibration.decide_greedy(ladder(*records, fast="logits", slow="fused"))

    # This AMX Xeon's measurements: the fused pick wins to 64 rows, loses at 256 (the AMX
    # kernel streams the weight once per 64 rows).
    xeon = ((1, 0.68, 0.64), (4, 0.70, 0.65), (16, 0.84, 0.64), (64, 1.77, 1.41), (256, 5.18, 5.81))
    assert greedy(*xeon) == (1, 64)
    assert greedy((1, 0.6, 0.7), (4, 0.7, 0.65), (64, 1.8, 1.4), (256, 6.0, 5.0)) == (2, None)
    assert greedy((1, 0.6, 0.7), (64, 1.0, 1.4)) is None  # never ahead


def test_the_lm_head_takes_the_amx_kernel_from_the_rows_it_wins_by_the_margin():
    def head(*records):  # (rows, skinny, packed, plain, amx) each
        keys = ("rows", "skinny", "packed", "plain", "amx")
        return calibration.decide_head([dict(zip(keys, r, strict=True)) for r in records])

    # like the AMX Xeon's real 262k head (ms, float32 logits): the skinny kernel to 4 rows,
    # then AMX (1.9x oneDNN's packed GEMM at 64 rows)
    xeon = ((1, 8, 15, 21, 12), (4, 9, 16, 23, 12), (16, 25, 17, 23, 13),
            (64, 90, 48, 60, 25), (256, 350, 120, 160, 80))  # fmt: skip
    assert head(*xeon) == HeadChoice(4, "packed", None, 5)
    # the same, but behind oneDNN at 256 rows (its compute there): AMX from 5 to 64 rows
    xeon_256 = (*xeon[:-1], (256, 350, 120, 160, 150))
    assert head(*xeon_256) == HeadChoice(4, "packed", None, 5, 64)
    assert [head(*xeon_256).takes_amx(r) for r in (4, 5, 64, 65)] == [False, True, True, False]
    # ahead only at the largest size: from the size after the last one it lost
    assert head((1, 1, 2, 2, 3), (64, 9, 4, 5, 5), (256, 40, 10, 12, 6)) == HeadChoice(
        1, "packed", None, 65
    )
    # within the margin everywhere (its copy of the weight is not worth it): never
    assert head((1, 1, 2, 2, 3), (64, 9, 4, 5, 3.9)).amx_min_rows is None
    # the AMX kernel counts as a GEMM against the skinny kernel too
    assert head((1, 1, 2, 2, 1.5), (4, 3, 9, 9, 2)).skinny_max_rows == 1


# "oneDNN for the LM head from 64 rows": the skinny kernel won at 16 rows, lost at 64
HEAD_MEASURED = [
    {"rows": 16, "skinny": 1.0, "packed": 2.0, "plain": 3.0},
    {"rows": 64, "skinny": 4.0, "packed": 1.0, "plain": 3.0},
]


@needs_onednn
@pytest.mark.usefixtures("needs_skinny")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("tied", [False, True])
def test_the_lm_head_runs_the_cached_choice(cache_dir, monkeypatch, dtype, tied):
    needs_packable(dtype)
    torch.manual_seed(3)
    hidden, vocab = 96, 700
    store(f"lm_head/{str(dtype).removeprefix('torch.')}/{hidden}x{vocab}", HEAD_MEASURED)
    linear = nn.Linear(hidden, vocab, bias=False).to(dtype)
    layer = None if tied else packed_linear.PackedLinear(linear, plain=True)
    head = lm_head.logits_head(layer, linear.weight.detach())
    assert isinstance(head, lm_head.LogitsHead)
    assert head.choice == HeadChoice(16, "packed") and head.packed is not None
    counts = count_paths(monkeypatch)
    for rows, path in ((16, "skinny"), (64, "packed")):
        before = dict(counts)
        x = torch.randn(rows, hidden).to(dtype)
        logits = lm_head.linear_float(head, x, linear.weight.detach())
        assert counts[path] == before[path] + 1 and sum(counts.values()) == sum(before.values()) + 1
        check_logits(logits, x, linear.weight, rounded=dtype == BF16 and path == "packed")


@needs_onednn
@pytest.mark.usefixtures("needs_skinny")
def test_the_lm_head_goes_back_to_the_plain_gemm_where_it_won(cache_dir, monkeypatch):
    needs_packable(BF16)
    torch.manual_seed(5)
    hidden, vocab = 96, 700
    measured = [
        {"rows": 16, "skinny": 1.0, "packed": 2.0, "plain": 3.0},
        {"rows": 64, "skinny": 4.0, "packed": 1.0, "plain": 3.0},
        {"rows": 256, "skinny": 16.0, "packed": 4.0, "plain": 2.0},
    ]
    store(f"lm_head/bfloat16/{hidden}x{vocab}", measured)
    linear = nn.Linear(hidden, vocab, bias=False).to(BF16)
    head = lm_head.logits_head(None, linear.weight.detach())
    assert head.choice == HeadChoice(16, "packed", 65) and head.packed is not None
    counts = count_paths(monkeypatch)
    for rows, path in ((16, "skinny"), (64, "packed"), (65, None), (200, None)):
        before = dict(counts)
        x = torch.randn(rows, hidden).to(BF16)
        logits = lm_head.linear_float(head, x, linear.weight.detach())
        after = {p: counts[p] - before[p] for p in counts}
        assert after == {p: int(p == path) for p in counts}, (rows, after)  # None: F.linear
        check_logits(logits, x, linear.weight, rounded=path != "skinny")


@needs_onednn
@pytest.mark.usefixtures("needs_skinny")
@pytest.mark.parametrize("tied", [False, True])
def test_the_lm_head_runs_the_amx_kernel_from_its_rows(cache_dir, monkeypatch, tied):
    if not packed_linear.amx_head_available(BF16, 96, 704):
        pytest.skip("no AMX tiles here (amx_bf16)")
    torch.manual_seed(6)
    hidden, vocab = 96, 704
    measured = [
        {"rows": 16, "skinny": 1.0, "packed": 2.0, "plain": 3.0, "amx": 2.5},
        {"rows": 64, "skinny": 4.0, "packed": 2.0, "plain": 3.0, "amx": 1.0},
    ]
    store(f"lm_head/bfloat16/{hidden}x{vocab}", measured)
    linear = nn.Linear(hidden, vocab, bias=False).to(BF16)
    layer = None if tied else packed_linear.PackedLinear(linear, plain=True)
    head = lm_head.logits_head(layer, linear.weight.detach())
    assert head.choice == HeadChoice(16, "packed", None, 17) and head.amx is not None
    counts = count_paths(monkeypatch)
    amx = packed_linear.amx_linear
    counts["amx"] = 0

    def counted_amx(*args):
        counts["amx"] += 1
        return amx(*args)

    monkeypatch.setattr(packed_linear, "amx_linear", counted_amx)
    for rows, path in ((16, "skinny"), (17, "amx"), (100, "amx")):
        before = dict(counts)
        x = torch.randn(rows, hidden).to(BF16)
        logits = lm_head.linear_float(head, x, linear.weight.detach())
        assert {p: counts[p] - before[p] for p in counts} == {p: int(p == path) for p in counts}
        check_logits(logits, x, linear.weight, rounded=False)  # float32 sums, unrounded


def needs_amx_head():
    if not packed_linear.amx_head_available(BF16, 96, 704):
        pytest.skip("no AMX tiles here (amx_bf16)")


@pytest.mark.usefixtures("needs_skinny")
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 65, 130])
def test_the_fused_argmax_is_torchs_argmax_of_the_amx_logits(rows):
    needs_amx_head()
    gen = torch.Generator().manual_seed(rows)
    hidden, vocab = 96, 16 * 45
    weight = torch.randn(vocab, hidden, generator=gen).to(BF16)
    weight[9] *= 4  # row 0 of x (= weight[9]) has its maximum at column 9, then ties in
    ties = [329, 400, vocab - 7]  # other tiles and threads, in its lane (9 + 16 k) or not
    weight[ties] = weight[9].clone()
    x = torch.randn(rows, hidden, generator=gen).to(BF16)
    x[0] = weight[9]
    packed = torch.ops.vlmserve_skinny.amx_pack(weight)
    logits = packed_linear.amx_linear(x, packed)
    assert (logits[0, ties] == logits[0, 9]).all() and logits[0, 9] == logits[0].max()
    assert torch.equal(packed_linear.amx_argmax(x, packed), logits.argmax(-1))
    weight[33, 5], weight[600, 7] = float("nan"), float("nan")  # every row: NaN at 33, 600
    packed = torch.ops.vlmserve_skinny.amx_pack(weight)
    logits = packed_linear.amx_linear(x, packed)
    assert logits[:, 33].isnan().all() and torch.equal(logits.argmax(-1), torch.full((rows,), 33))
    assert torch.equal(packed_linear.amx_argmax(x, packed), logits.argmax(-1))


@needs_onednn
@pytest.mark.usefixtures("needs_skinny")
def test_greedy_tokens_come_from_the_amx_head_at_the_rows_calibrated(cache_dir, monkeypatch):
    needs_amx_head()
    torch.manual_seed(7)
    hidden, vocab = 96, 704
    store(f"lm_head/bfloat16/{hidden}x{vocab}", [
        {"rows": 16, "skinny": 1.0, "packed": 2.0, "plain": 3.0, "amx": 2.5},
        {"rows": 64, "skinny": 4.0, "packed": 2.0, "plain": 3.0, "amx": 1.0},
    ])  # fmt: skip
    store(f"lm_head_argmax/bfloat16/{hidden}x{vocab}", [
        {"rows": 16, "logits": 1.0, "fused": 1.5},
        {"rows": 64, "logits": 3.0, "fused": 1.0},
        {"rows": 256, "logits": 4.0, "fused": 8.0},
    ])  # fmt: skip
    linear = nn.Linear(hidden, vocab, bias=False).to(BF16)
    head = lm_head.logits_head(None, linear.weight.detach())
    assert head.greedy_rows == (17, 64)
    calls, fused = [], packed_linear.amx_argmax
    monkeypatch.setattr(packed_linear, "amx_argmax", lambda *a: calls.append(1) or fused(*a))
    for rows, takes in ((16, False), (17, True), (64, True), (65, False)):
        x = torch.randn(rows, hidden).to(BF16)
        before = len(calls)
        ids = head.argmax(x)
        assert (ids is not None) == takes and len(calls) - before == int(takes), rows
        if takes:
            assert torch.equal(ids, head(x).argmax(-1))


def check_logits(logits, x, weight, rounded: bool) -> None:
    """float32 logits within float32 summation error of float64 x @ W.T (plus one bfloat16
    rounding of the output where the GEMM wrote bfloat16)."""
    assert logits.dtype == torch.float32
    exact = x.double() @ weight.detach().double().T
    magnitude = x.double().abs() @ weight.detach().double().abs().T
    bound = x.shape[-1] * 2.0**-24 * magnitude + (2.0**-8 * exact.abs() if rounded else 0) + 1e-6
    assert ((logits.double() - exact).abs() <= bound).all()


@needs_onednn
@pytest.mark.usefixtures("needs_skinny")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_every_head_path_equals_f_linear(cache_dir, monkeypatch, dtype):
    """Each of the three paths, on the same weights, against float64 (and F.linear)."""
    needs_packable(dtype)
    torch.manual_seed(4)
    linear = nn.Linear(128, 300, bias=False).to(dtype)
    x = torch.randn(24, 128).to(dtype)
    for choice in (HeadChoice(64, "plain"), HeadChoice(0, "packed"), HeadChoice(0, "plain")):
        monkeypatch.setattr(lm_head, "head_choice", lambda *a, c=choice: c)
        head = lm_head.logits_head(None, linear.weight.detach())
        logits = head(x)
        check_logits(logits, x, linear.weight, rounded=dtype == BF16 and not choice[0])
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(logits, F.linear(x, linear.weight).float(), rtol=tol, atol=tol)


def test_the_head_ladder_goes_on_after_the_skinny_kernel_lost(monkeypatch):
    """The skinny kernel losing at 1 and 4 rows ends a linear's ladder; the LM head's goes
    on to its largest size, where the packed-or-plain choice is made."""
    fixed = {"skinny": 3.0, "onednn": 1.0, "packed": 1.0, "plain": 1.2}
    monkeypatch.setattr(
        calibration, "time_paths", lambda paths, rounds=0: {p: fixed[p] for p in paths}
    )
    ladder = lm_head.HEAD_LADDER
    for paths in (("skinny", "packed", "plain"), ("skinny", "plain")):  # no oneDNN: plain
        head = packed_linear.measure_ladder(torch.float32, 64, 32, ladder, paths, logits=True)
        assert [r["rows"] for r in head] == list(ladder)
    linear = packed_linear.measure_ladder(torch.float32, 64, 32, ladder, ("skinny", "onednn"))
    assert [r["rows"] for r in linear] == list(ladder[:2])

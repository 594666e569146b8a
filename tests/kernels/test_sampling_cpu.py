"""The sampler's CPU kernels (kernels/sampling_cpu.py): the token mask against the bits read
by hand and against xgrammar's own CPU kernel; the temperature weights bitwise equal to the
plain ops."""

from __future__ import annotations

import pytest
import torch

from kernels import sampling_cpu


@pytest.fixture(autouse=True)
def needs_the_kernel():
    """It builds on first use: when a test here runs, never at collection."""
    if (why := sampling_cpu.available()) is not None:
        pytest.skip(f"the sampling kernels did not build: {why}")


def random_bitmask(num_rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of every kind: mixed bits, all refused, all allowed, few allowed, and one that
    allows only the padding bits past the vocabulary (so, no token)."""
    num_words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31, (num_rows, num_words), generator=gen)
    bitmask = bits.to(torch.int32)
    bitmask[1] = 0
    bitmask[2] = -1
    bitmask[3] = 0
    bitmask[3, num_words // 2] = 1 << 7  # one token
    if vocab % 32:
        bitmask[4] = 0
        bitmask[4, -1] = -(1 << (vocab % 32))  # only bits >= vocab set
    return bitmask


def by_hand(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> list[bool]:
    """Bit by bit in Python (the slow, obvious reading of the layout)."""
    vocab = logits.shape[-1]
    words = bitmask.tolist()
    out = []
    for row in rows:
        allowed = [(words[row][t // 32] >> (t % 32)) & 1 for t in range(vocab)]
        refused = torch.tensor([a == 0 for a in allowed])
        logits[row, refused] = float("-inf")
        out.append(any(allowed))
    return out


@pytest.mark.parametrize("vocab", [1000, 1024, 40])
def test_kernel_matches_the_bits_read_by_hand(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen)
    bitmask = random_bitmask(8, vocab, gen)
    rows = [0, 1, 2, 3, 4, 6]  # rows 5, 7 and 8 (no bitmask row) are not listed
    want = logits.clone()
    want_any = by_hand(want, bitmask, rows)
    got = logits.clone()
    assert sampling_cpu.apply_token_bitmask_(got, bitmask, rows) == want_any
    assert torch.equal(got, want)  # -inf where refused, untouched elsewhere (bitwise)
    eager = logits.clone()
    assert sampling_cpu.apply_token_bitmask_eager(eager, bitmask, rows) == want_any
    assert torch.equal(eager, want)
    assert want_any[1] is False and want_any[3] is True
    assert want_any[4] is (vocab % 32 == 0)  # only padding bits: no token allowed


def test_kernel_matches_xgrammars_kernel_on_a_strided_view() -> None:
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    wide = torch.randn(6, vocab + 96, generator=gen)
    bitmask = random_bitmask(6, vocab, gen)
    rows = [5, 0, 2, 3]
    before = wide.clone()
    want = before[:, :vocab].clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
    got = wide[:, :vocab]  # rows of stride vocab + 96
    sampling_cpu.apply_token_bitmask_(got, bitmask, rows)
    assert torch.equal(got, want)
    assert torch.equal(wide[:, vocab:], before[:, vocab:])  # past the view: untouched


def test_bad_inputs_are_refused() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="outside"):
        sampling_cpu.apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), [2])
    with pytest.raises(RuntimeError, match="cover fewer"):
        sampling_cpu.apply_token_bitmask_(logits, torch.zeros(2, 1, dtype=torch.int32), [0])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.05, 3.0])
def test_temperature_weights_are_bitwise_the_plain_ops(temperature: float) -> None:
    gen = torch.Generator().manual_seed(int(temperature * 100))
    logits = torch.randn(7, 1001, generator=gen) * 8  # some lanes past exp's range at 0.05
    logits[1, torch.rand(1001, generator=gen) < 0.9] = float("-inf")  # a masked row
    logits[2, :500] = float("-inf")
    logits[3] = float("-inf")  # nothing allowed (a failed row)
    logits[4, 3] = float("nan")
    logits[5, 7] = float("inf")
    wide = torch.randn(7, 1100, generator=gen)
    wide[:, :1001] = logits
    temps = torch.full((7,), temperature)
    for x in (logits, wide[:, :1001]):  # dense and strided rows
        top = x.amax(-1, keepdim=True)
        want = sampling_cpu.temperature_weights_eager(x, top, temps)
        got = sampling_cpu.temperature_weights(x, top, temps)
        ok = torch.isfinite(top.squeeze(-1))  # the failed rows' weights mean nothing
        assert torch.equal(got[ok], want[ok])  # bitwise, -inf lanes exactly 0
        assert (got[1][logits[1] == float("-inf")] == 0).all()


def hard_rows(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows argmax can get wrong: ties (inside a vector, across vectors and 16k chunks),
    NaNs before and after the maximum, nothing but -inf, +inf, -0.0 against 0.0."""
    rows = torch.randn(12, vocab, generator=gen) * 4
    last, mid = vocab - 1, vocab // 2
    rows[0, [last, mid, 3 % vocab]] = 50.0  # three ties: the first wins
    rows[1, mid] = float("nan")  # NaN wins over any value, the first NaN
    rows[1, last] = float("nan")
    rows[1, 0] = 90.0
    rows[2] = float("-inf")  # nothing but -inf: index 0
    rows[3, last] = float("nan")  # a NaN in the tail after the maximum
    rows[4, [mid, last]] = float("inf")
    rows[5] = 0.0
    rows[5, : vocab // 3] = -0.0  # -0.0 == 0.0: the first zero
    rows[6] = rows[6].round()  # many ties among the values
    rows[7, torch.rand(vocab, generator=gen) < 0.9] = float("-inf")  # a masked row
    rows[8, [last]] = 1e30
    if vocab > 40000:  # ties in different chunks (16,384 columns a chunk) and lanes
        rows[9, [16384 + 5, 3 * 16384, 2 * 16384 + 1]] = 77.0
        rows[10, [16383, 16384]] = 77.0
        rows[11, 200_000] = float("nan")
    return rows


@pytest.mark.parametrize("vocab", [1, 7, 63, 64, 100, 1000, 32000, 262144])
def test_argmax_is_torchs_argmax(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = hard_rows(vocab, gen)
    want = logits.argmax(-1)
    assert torch.equal(sampling_cpu.argmax(logits), want)
    assert torch.equal(sampling_cpu.argmax_eager(logits), want)
    rows = torch.tensor([11, 0, 0, 7, 2, 1])  # a subset, repeated, out of order
    assert torch.equal(sampling_cpu.argmax(logits, rows), want[rows])
    wide = torch.randn(12, vocab + 33, generator=gen)
    wide[:, :vocab] = logits
    assert torch.equal(sampling_cpu.argmax(wide[:, :vocab]), want)  # strided rows
    # bfloat16, as a GEMM writes a greedy head's logits: the argmax of the widened values
    # (ties made by the rounding included), strided rows too
    half = logits.to(torch.bfloat16)
    assert sampling_cpu.can_argmax(half) and not sampling_cpu.can_run(half)
    assert torch.equal(sampling_cpu.argmax(half), half.float().argmax(-1))
    assert torch.equal(sampling_cpu.argmax_any(half, rows), half.float().argmax(-1)[rows])
    assert torch.equal(
        sampling_cpu.argmax(wide.to(torch.bfloat16)[:, :vocab]), half.float().argmax(-1)
    )


def test_argmax_on_many_rows_of_a_large_vocabulary() -> None:
    """64 rows of 262,144 (the real model's decode step): every row a unit, or 16."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 262144, generator=gen)
    logits[::3, 100_000] = 9.0  # a tie with a later chunk's maximum in some rows
    logits[::5, 250_000] = 9.0
    assert torch.equal(sampling_cpu.argmax(logits), logits.argmax(-1))


def test_argmax_refuses_bad_rows() -> None:
    with pytest.raises(RuntimeError, match="outside"):
        sampling_cpu.argmax(torch.zeros(2, 8), torch.tensor([2]))

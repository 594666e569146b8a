"""The batched sampling ops against the plain-torch reference (`filtered_probs`) and an
exact float64 inverse CDF."""

from __future__ import annotations

import pytest
import torch

import vlmserve.sample.ops as sampling_ops
from kernels import sampling_cpu
from vlmserve.sample.ops import (
    draw,
    filter_top_k_top_p_,
    inverse_cdf,
    num_top_candidates,
    temperature_weights,
)
from vlmserve.sample.params import SamplingParams, filtered_probs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
MIXED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.6),
    SamplingParams(temperature=1.0, top_p=1e-300),
    SamplingParams(temperature=1e-5),
    SamplingParams(temperature=2.0, top_k=10_000),  # k >= vocab: off
    SamplingParams(temperature=1.0, top_k=3, top_p=0.99),
    SamplingParams(temperature=3.0, top_p=0.95),  # a wide nucleus: the CPU guess widens
]


def filtered(logits: torch.Tensor, params: list[SamplingParams], num: int) -> torch.Tensor:
    """Normalised weights after temperature, top-k and top-p, as the batch sampler does."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    weights, failed = temperature_weights(logits, temperature)
    assert not failed.any()
    top_k = torch.tensor([p.top_k if p.top_k < vocab else 0 for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    filter_top_k_top_p_(weights, None, top_k.to(logits.device), top_p.to(logits.device), num)
    return weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_candidates", [3, 64, 300])
def test_filters_match_the_reference(device, num_candidates):
    logits = torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(0)) * 3
    got = filtered(logits.to(device), MIXED, max(num_candidates, 40)).cpu()
    want = torch.stack([filtered_probs(row, p) for row, p in zip(logits, MIXED, strict=True)])
    assert torch.equal(got > 0, want > 0)  # the same tokens survive
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got[4].count_nonzero() == 1 and got[5].count_nonzero() == 1  # point masses


def test_top_p_keeps_the_prefix_that_reaches_it():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    params = [SamplingParams(top_p=0.8), SamplingParams(top_p=0.81)]
    got = filtered(logits, params, 2)
    torch.testing.assert_close(got[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert got[1, 2] > 0 and got[1, 3] == 0


def test_a_subset_of_rows_is_filtered_alone():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    weights, _ = temperature_weights(logits, torch.ones(6))
    before = weights.clone()
    rows = torch.tensor([1, 4])
    filter_top_k_top_p_(weights, rows, torch.tensor([3, 0]), torch.tensor([1.0, 0.5]), 3)
    untouched = [0, 2, 3, 5]
    assert torch.equal(weights[untouched], before[untouched])
    assert weights[1].count_nonzero() == 3
    want = filtered_probs(logits[4], SamplingParams(top_p=0.5))
    torch.testing.assert_close(weights[4] / weights[4].sum(), want)


def test_candidates_cover_every_top_k_and_sort_on_an_accelerator():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert num_top_candidates(cpu, 1000, [5, 700], top_p=False) == 700
    assert num_top_candidates(cpu, 1000, [], top_p=True) == 128
    assert num_top_candidates(cpu, 50, [], top_p=True) == 50
    assert num_top_candidates(cuda, 1000, [5], top_p=True) == 1000


def test_non_finite_rows_are_flagged():
    logits = torch.zeros(4, 8)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3] = float("-inf")
    _, failed = temperature_weights(logits, torch.ones(4))
    assert failed.tolist() == [False, True, True, True]


def exact_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The float64 inverse CDF over whole rows, the reference."""
    ends = weights.double().cumsum(-1)
    return torch.searchsorted(ends, u[:, None] * ends[:, -1:], right=True).squeeze(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [68, 512, 1000])  # one block, whole blocks, a padded block
def test_inverse_cdf_is_the_exact_one(device, vocab):
    gen = torch.Generator().manual_seed(vocab)
    weights = torch.rand(64, vocab, generator=gen) ** 8  # uneven, across blocks
    weights[weights < 0.05] = 0.0
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    for _ in range(20):
        got = inverse_cdf(weights.to(device), u.to(device)).cpu()
        assert torch.equal(got, exact_inverse_cdf(weights, u))
        u = torch.rand(64, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_never_draws_a_zero_weight(device):
    vocab = 1000  # the last block is padding after column 999
    weights = torch.zeros(6, vocab)
    weights[0, 0] = 1.0
    weights[1, vocab - 1] = 1e-30
    weights[2, [3, 700]] = torch.tensor([1.0, 1e-38])
    weights[3, 255:257] = 0.5  # both sides of a block boundary
    weights[4, 511] = 2.0
    weights[5] = torch.rand(vocab) * (torch.arange(vocab) % 7 == 0)
    support = [set(row.nonzero().squeeze(-1).tolist()) for row in weights]
    for u in (0.0, 1.0 - 2.0**-53, 0.5, 1e-300):
        us = torch.full((6,), u, dtype=torch.float64)
        got = inverse_cdf(weights.to(device), us.to(device))
        assert all(t in s for t, s in zip(got.tolist(), support, strict=True)), (u, got)


@pytest.mark.parametrize("device", DEVICES)
def test_draw_accepts_with_p_of_the_draft_and_resamples_without_it(device, chi_square):
    num = 40_000
    probs = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.0, 0.3])
    weights = (probs * 7.0).expand(num, -1).contiguous()  # unnormalised on purpose
    gen = torch.Generator().manual_seed(5)
    u_accept, u_sample = torch.rand(2, num, generator=gen, dtype=torch.float64)
    rows = torch.arange(0, num, 2)  # every other row has draft 3; the others none
    tokens, accepted = draw(
        weights.to(device), u_accept.to(device), u_sample.to(device),
        rows.to(device), torch.full_like(rows, 3).to(device),
    )  # fmt: skip
    tokens, accepted = tokens.cpu(), accepted.cpu()
    assert not accepted[1::2].any()
    rate = accepted[0::2].double().mean()
    assert abs(rate - 0.25) < 4 * (0.25 * 0.75 / (num / 2)) ** 0.5
    without = probs.clone()
    without[3] = 0
    residual = torch.bincount(tokens[0::2], minlength=6)
    assert chi_square(residual, without / without.sum()) > 1e-3
    plain = torch.bincount(tokens[1::2], minlength=6)
    assert chi_square(plain, probs) > 1e-3
    assert chi_square(residual, probs) < 1e-6  # the test has the power to see it


def test_filters_match_the_reference_at_a_262k_vocabulary():
    """The real Gemma 3's vocabulary: top-k on a candidate set, top-p nuclei of thousands of
    tokens (temperature 3) that outgrow the first guess, against full-sort references."""
    logits = torch.randn(len(MIXED), 262144, generator=torch.Generator().manual_seed(5)) * 3
    num = num_top_candidates(logits.device, 262144, [p.top_k for p in MIXED], top_p=True)
    got = filtered(logits, MIXED, num)
    want = torch.stack([filtered_probs(row, p) for row, p in zip(logits, MIXED, strict=True)])
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got[8].count_nonzero() > 1000  # the wide nucleus was reached


def test_widening_to_the_nucleus_size_cuts_as_widening_8x_does(monkeypatch):
    """On the CPU a row whose nucleus outgrows its candidates takes as many as the kernel's
    bound at once; the weights are bitwise those of widening 8x at a time."""
    if sampling_cpu.available() is not None:
        pytest.skip("the sampling kernels did not build")
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 20000, generator=gen) * torch.tensor([[0.5], [3], [6], [1], [9]])
    weights, _ = temperature_weights(logits, torch.full((5,), 1.5))
    top_k = torch.tensor([0, 0, 3000, 0, 0])
    top_p = torch.tensor([0.99, 0.9, 0.95, 0.5, 0.999])
    calls = []
    bounded = weights.clone()
    wider = sampling_ops._wider
    monkeypatch.setattr(sampling_ops, "_wider", lambda *a: calls.append(wider(*a)) or calls[-1])
    filter_top_k_top_p_(bounded, None, top_k, top_p, 128)
    assert len(calls) == 1 and calls[0] > 1024  # one widening, past what 8x would take
    monkeypatch.setattr(sampling_ops, "_wider", lambda w, r, p, num: 8 * num)
    widened = weights.clone()
    filter_top_k_top_p_(widened, None, top_k, top_p, 128)
    assert torch.equal(bounded, widened)


@pytest.mark.parametrize("vocab", [1000, 262144])
def test_nucleus_sizes_hold_the_nucleus_and_little_more(vocab):
    if sampling_cpu.available() is not None:
        pytest.skip("the sampling kernels did not build")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([[0.3], [1], [2], [4], [8], [1]])
    weights, _ = temperature_weights(logits, torch.ones(6))
    weights[5, 7] = float("nan")  # a failed row: 1
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.99, 0.7, 0.9])
    sizes = sampling_cpu.nucleus_sizes(weights, top_p).tolist()
    sizes_of_rows = sampling_cpu.nucleus_sizes(weights, top_p[[3, 0]], torch.tensor([3, 0]))
    assert sizes_of_rows.tolist() == [sizes[3], sizes[0]]
    assert sizes[5] == 1
    for row in range(5):  # the reference nucleus: sort, keep while the mass before < top_p
        probs = (weights[row] / weights[row].sum()).sort(descending=True).values
        kept = int(((probs.cumsum(-1) - probs) < top_p[row]).sum())
        assert kept < sizes[row] <= min(vocab, kept * 1.15 + 16), (row, kept, sizes[row])

"""Batched sampling end to end: frequencies against `filtered_probs`, seeded requests alone
and in a batch, greedy rows, drafts, failures. Fixed seeds: every run draws the same."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import vlmserve.sample.ops as sampling_ops
from vlmserve.sample.params import SamplerState, SamplingParams, filtered_probs
from vlmserve.sample.sampler import RowGroup, sample, sample_rows
from vlmserve.sample.verify import accept_drafts

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
COMBOS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.9),
    SamplingParams(temperature=2.5, top_p=0.97),  # a nucleus past 128 tokens: widens on CPU
]
GREEDY = SamplingParams(temperature=0.0)


def logits_row(vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def seeded(params: SamplingParams, seed: int) -> SamplerState:
    return SamplerState(replace(params, seed=seed))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_frequencies_match_the_filtered_softmax(device, chi_square):
    """One batch, the combos' rows interleaved with greedy rows: each combo's tokens follow
    filtered_probs (chi-square), greedy rows are the argmax."""
    vocab, per_combo = 300, 6000
    row = logits_row(vocab, 0)
    kinds = [*COMBOS, GREEDY]
    states = [seeded(kinds[i % len(kinds)], i) for i in range(per_combo * len(kinds))]
    tokens = torch.tensor(sample(row.expand(len(states), -1).to(device), states))
    assert (tokens[len(COMBOS) :: len(kinds)] == row.argmax()).all()
    for i, params in enumerate(COMBOS):
        counts = torch.bincount(tokens[i :: len(kinds)], minlength=vocab)
        assert chi_square(counts, filtered_probs(row, params)) > 1e-3, params


def test_the_frequency_test_sees_a_missing_filter(chi_square):
    """Power check: tokens drawn without top-p fail the top-p comparison."""
    row = logits_row(300, 0)
    states = [seeded(SamplingParams(temperature=1.2), i) for i in range(6000)]
    tokens = torch.tensor(sample(row.expand(len(states), -1), states))
    counts = torch.bincount(tokens, minlength=300)
    assert chi_square(counts, filtered_probs(row, COMBOS[2])) < 1e-6


def random_batch(seed: int, vocab: int, num: int, first_row: int) -> list[RowGroup]:
    """`num` groups of mixed kinds (greedy, filters, 0-3 drafts) from `first_row` on."""
    gen = torch.Generator().manual_seed(seed)
    kinds = [*COMBOS, GREEDY]
    groups = []
    for i in range(num):
        params = kinds[int(torch.randint(len(kinds), (), generator=gen))]
        num_drafts = int(torch.randint(4, (), generator=gen))
        drafts = tuple(torch.randint(vocab, (num_drafts,), generator=gen).tolist())
        groups.append(RowGroup(seeded(params, 1000 * seed + i), first_row, drafts))
        first_row += 1 + num_drafts
    return groups


def num_rows(groups: list[RowGroup]) -> int:
    return sum(1 + len(g.draft_token_ids) for g in groups)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [68, 32000])  # the embedded model's, a Llama-2 one
def test_a_seeded_request_draws_the_same_alone_and_in_any_batch(device, vocab):
    for i, (params, drafts) in enumerate([(p, d) for p in COMBOS for d in ((), (5, 1, 2))]):
        mine = torch.randn(1 + len(drafts), vocab, generator=torch.Generator().manual_seed(i))
        alone = sample_rows(mine.to(device), [RowGroup(seeded(params, 7), 0, drafts)])
        for trial in range(2 if vocab < 1000 else 1):
            before = random_batch(trial, vocab, 5, 0)
            again = RowGroup(seeded(params, 7), num_rows(before), drafts)
            after = random_batch(trial + 10, vocab, 4, again.first_row + len(mine))
            others = [torch.randn(num_rows(g), vocab) for g in (before, after)]
            parts = [others[0], mine, others[1]]
            results = sample_rows(torch.cat(parts).to(device), [*before, again, *after])
            assert results[len(before)] == alone[0], (params, drafts, trial)


@pytest.mark.parametrize("device", DEVICES)
def test_drawing_by_draft_position_gives_the_tokens_of_one_batch(device):
    """The CPU skips rows after a rejection; the accelerators draw every row at once."""
    outcomes = set()
    for seed in range(3):
        groups = random_batch(seed, 1000, 40, 0)
        logits = torch.randn(num_rows(groups), 1000, generator=torch.Generator().manual_seed(seed))
        for g in groups:  # likely drafts, so that runs of them are accepted
            for i, draft in enumerate(g.draft_token_ids):
                logits[g.first_row + i, draft] += 7.0
        results = []
        for by_position in (True, False):
            again = [g._replace(state=seeded(g.state.params, g.state.params.seed)) for g in groups]
            results.append(sample_rows(logits.to(device), again, by_position=by_position))
        assert results[0] == results[1]
        outcomes |= {(len(r.accepted), all(r.accepted)) for r in results[0] if r.accepted}
    assert {(3, True), (3, False), (1, False)} <= outcomes  # all held; late and early misses


@pytest.mark.parametrize("by_position", [True, False])
def test_batches_of_a_few_rows_draw_the_tokens_of_one_batch(monkeypatch, by_position):
    """On the CPU the sampling rows go in batches of bounded memory (8 rows at a 262k
    vocabulary); here 3 rows at a time against one batch of every row."""
    import vlmserve.sample.sampler as sampler

    vocab = 1000
    groups = random_batch(5, vocab, 30, 0)
    logits = torch.randn(num_rows(groups), vocab, generator=torch.Generator().manual_seed(5))
    for g in groups[::2]:  # likely drafts: runs of them accepted
        for i, draft in enumerate(g.draft_token_ids):
            logits[g.first_row + i, draft] += 7.0

    def run() -> list:
        again = [g._replace(state=seeded(g.state.params, g.state.params.seed)) for g in groups]
        return sample_rows(logits, again, by_position=by_position)

    assert sampler.rows_per_batch(torch.device("cpu"), 262144) == 8
    assert sampler.rows_per_batch(torch.device("cuda"), 262144) is None
    whole = run()
    monkeypatch.setattr(sampler, "BATCH_BYTES", 3 * 4 * vocab)
    assert sampler.rows_per_batch(torch.device("cpu"), vocab) == 3
    assert run() == whole
    assert sum(len(r.token_ids) for r in whole) > 40  # many rows, most groups sampled


def test_a_seeded_request_repeats_over_steps():
    logits = torch.randn(20, 4, 500, generator=torch.Generator().manual_seed(3))

    def run() -> list[list[int]]:
        state = seeded(COMBOS[3], 11)
        return [sample_rows(step, [RowGroup(state, 0, (1, 2, 3))])[0].token_ids for step in logits]

    first = run()
    assert run() == first
    assert len({tuple(t) for t in first}) > 1  # not a constant


def test_greedy_rows_and_point_masses_take_the_argmax():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(4))
    params = [
        GREEDY,
        SamplingParams(temperature=1e-40),  # under GREEDY_TEMPERATURE: greedy
        SamplingParams(temperature=1e-5, seed=1),  # sampled, but a point mass
        SamplingParams(temperature=1.0, top_p=1e-300, seed=2),
        SamplingParams(temperature=1.0, top_k=1, seed=3),
    ]
    assert sample(logits, [SamplerState(p) for p in params]) == logits.argmax(-1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_verification_emits_tokens_distributed_as_p(device, monkeypatch, chi_square):
    """Lossless: with drafts (2, 0) over rows p0, p1, p2 the first token follows p0, and
    after an accepted first draft the second follows p1. Without removing a rejected
    draft from p (the bug) the first token does not."""
    vocab, num = 12, 8000
    rows = torch.stack([logits_row(vocab, s) for s in (20, 21, 22)])
    params = SamplingParams(temperature=1.0, top_k=9)
    p0, p1 = (filtered_probs(r, params) for r in rows[:2])

    def emitted() -> list[list[int]]:
        groups = [RowGroup(seeded(params, i), 3 * i, (2, 0)) for i in range(num)]
        results = sample_rows(rows.repeat(num, 1).to(device), groups)
        return [accept_drafts(g.draft_token_ids, r) for g, r in zip(groups, results, strict=True)]

    out = emitted()
    first = torch.tensor([t[0] for t in out])
    assert chi_square(torch.bincount(first, minlength=vocab), p0) > 1e-3
    second = torch.tensor([t[1] for t in out if t[0] == 2])
    assert chi_square(torch.bincount(second, minlength=vocab), p1) > 1e-3
    monkeypatch.setattr(sampling_ops, "remove_draft_", lambda weights, rows, ids: None)
    first = torch.tensor([t[0] for t in emitted()])
    assert chi_square(torch.bincount(first, minlength=vocab), p0) < 1e-6


def test_bad_rows_fail_their_group_alone():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(6))
    logits[1, 7] = float("nan")
    logits[4] = float("-inf")
    kinds = [COMBOS[2], COMBOS[2], GREEDY, COMBOS[0], COMBOS[0]]
    groups = [RowGroup(seeded(p, i), i) for i, p in enumerate(kinds)]
    results = sample_rows(logits, groups)
    assert [r.error is None for r in results] == [True, False, True, True, False]
    for i in (0, 2, 3):  # the others drew what they draw alone
        alone = sample_rows(logits[i : i + 1], [RowGroup(seeded(kinds[i], i), 0)])
        assert results[i] == alone[0]
    with pytest.raises(ValueError, match="row 1: logits are not finite"):
        sample(logits[:2], [g.state for g in groups[:2]])


def test_a_draft_outside_the_vocabulary_fails_its_group():
    groups = [RowGroup(seeded(COMBOS[0], 0), 0, (50,)), RowGroup(seeded(COMBOS[0], 1), 2, (3,))]
    results = sample_rows(torch.randn(4, 50), groups)
    assert "outside the vocabulary" in results[0].error and results[1].error is None

"""Logit controls (penalties, logit_bias, bad_words, min_tokens, min_p) against a plain
per-row torch reference written from vLLM's definitions, on the same logits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vlmserve.sample.controls import apply_controls
from vlmserve.sample.params import SamplerState, SamplingParams, filtered_probs
from vlmserve.sample.sampler import RowGroup, sample, sample_rows

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
VOCAB = 50


def reference(logits: torch.Tensor, state: SamplerState, history: list[int]) -> torch.Tensor:
    """One row, one control at a time, with Python loops (vLLM v1's order)."""
    p, x = state.params, logits.double().clone()
    for word in state.bad_words_ids:
        if len(word) == 1 or history[len(history) - len(word) + 1 :] == list(word[:-1]):
            x[word[-1]] = float("-inf")
    if len(history) < p.min_tokens:
        for token in state.stop_token_ids:
            x[token] = float("-inf")
    for token, bias in p.logit_bias:
        x[token] += bias
    for token in set(state.prompt_token_ids) | set(history):
        if p.repetition_penalty != 1.0:
            x[token] = (
                x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
            )
    for token in set(history):
        x[token] -= p.frequency_penalty * history.count(token) + p.presence_penalty
    return x.float()


def make_state(seed: int, **kw) -> SamplerState:
    state = SamplerState(SamplingParams(seed=seed, **kw))
    gen = torch.Generator().manual_seed(seed)
    state.prompt_token_ids = tuple(torch.randint(0, VOCAB, (12,), generator=gen).tolist())
    state.output_token_ids = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    state.stop_token_ids = (2, 7)
    state.bad_words_ids = ((11,), (state.output_token_ids[-1], 13), (40, 41))
    return state


CONTROLS = [
    dict(presence_penalty=0.7),
    dict(frequency_penalty=-0.4),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, frequency_penalty=1.1, presence_penalty=-0.5),
    dict(logit_bias={3: 5.0, 8: -100.0, 20: 0.25}),
    dict(bad_words=("x",)),
    dict(min_tokens=20, max_tokens=30),
    dict(min_tokens=5, repetition_penalty=1.3, logit_bias={1: 2.0}, bad_words=("x",)),
]


@pytest.mark.parametrize("device", DEVICES)
def test_controls_equal_the_reference_per_row(device):
    """A batch mixing every control, plain rows and a drafting group: each row equals the
    reference over its own history (drafts before a row count as output)."""
    logits = torch.randn(len(CONTROLS) + 4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    groups, expected = [], logits.clone()
    for i, kw in enumerate(CONTROLS):
        state = make_state(i, **kw)
        if not state.params.bad_words:
            state.bad_words_ids = ()
        groups.append(RowGroup(state, i))
        expected[i] = reference(logits[i], state, list(state.output_token_ids))
    plain = SamplerState(SamplingParams())
    groups.append(RowGroup(plain, len(CONTROLS)))  # untouched
    drafting = make_state(99, frequency_penalty=1.5, repetition_penalty=1.2)
    drafts = (4, 4)
    groups.append(RowGroup(drafting, len(CONTROLS) + 1, drafts))
    for j in range(3):
        row = len(CONTROLS) + 1 + j
        history = [*drafting.output_token_ids, *drafts[:j]]
        expected[row] = reference(logits[row], drafting, history)
    out = apply_controls(logits.to(device), groups).cpu()
    assert torch.equal(out.isinf(), expected.isinf())
    finite = expected.isfinite()
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-6, atol=1e-5)
    assert not torch.equal(out, logits)  # the controls did something


def test_without_controls_the_logits_are_the_same_tensor():
    logits = torch.randn(2, VOCAB)
    groups = [
        RowGroup(SamplerState(SamplingParams()), 0),
        RowGroup(SamplerState(SamplingParams(top_k=3)), 1),
    ]
    assert apply_controls(logits, groups) is logits


def test_greedy_rows_take_the_argmax_of_the_controlled_logits():
    """Penalties reach greedy rows too: the argmax of the reference, not of the raw row."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    top = int(logits.argmax())
    state = SamplerState(SamplingParams(temperature=0.0, frequency_penalty=2.0))
    state.output_token_ids = [top] * 10
    token = sample(logits, [state])[0]
    assert token != top
    assert token == int(reference(logits[0], state, state.output_token_ids).argmax())


def test_seeded_sampling_with_controls_draws_from_the_controlled_distribution():
    """The sampled token equals an inverse-CDF draw with the same uniform over the
    reference's filtered probabilities (the exact seeded sampling is kept)."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    for seed in range(40):
        state = make_state(seed, temperature=0.8, presence_penalty=1.0, logit_bias={9: 3.0},
                           min_p=0.05)  # fmt: skip
        state.bad_words_ids = ()
        twin = SamplerState(state.params)
        twin.rng.random()  # the accept uniform
        u = twin.rng.random()
        probs = filtered_probs(reference(logits, state, state.output_token_ids), state.params)
        want = int(
            torch.searchsorted(
                probs.double().cumsum(0),
                torch.tensor([u]).double() * probs.double().sum(),
                right=True,
            ).clamp(max=VOCAB - 1)
        )
        got = sample_rows(logits[None], [RowGroup(state, 0)])[0].token_ids[0]
        assert got == want, seed


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_keeps_only_tokens_near_the_top(device):
    logits = torch.tensor([[0.0, -0.5, -1.0, -3.0, -8.0]] * 400, device=device)
    states = [SamplerState(SamplingParams(min_p=0.3, seed=i)) for i in range(400)]
    tokens = set(sample(logits, states))
    # p / p_max = exp(logit): 1, 0.61, 0.37 stay; 0.05 and 0.0003 go
    assert tokens == {0, 1, 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(bad_words=("",)), "bad_words"),
        (dict(logprobs=21), "logprobs"),
        (dict(n=0), "n="),
        (dict(n=3, best_of=2), "best_of"),
    ],
)
def test_bad_controls_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_dict_logit_bias_becomes_pairs():
    params = SamplingParams(logit_bias={3: 1})
    assert params.logit_bias == ((3, 1.0),)
    assert replace(params, max_tokens=4).logit_bias == ((3, 1.0),)

from __future__ import annotations

import pytest
import torch

from vlmserve.sample.params import SamplerState, SamplingParams, filtered_probs
from vlmserve.sample.sampler import sample


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 0.0]])
    states = [SamplerState(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert sample(logits, states) == [1, 0]


def test_top_k_and_top_p_remove_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p 0.8: 0.5 + 0.3 reaches 0.8, so the rest goes.
    probs = filtered_probs(logits, SamplingParams(top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = filtered_probs(logits, SamplingParams(top_p=0.81))
    assert probs[2] > 0 and probs[3] == 0


def test_seeded_requests_repeat_and_do_not_depend_on_the_batch():
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits, [SamplerState(params)])[0] for _ in range(1)]
    state = SamplerState(params)
    other = SamplerState(SamplingParams(temperature=1.0, seed=99))
    batched = sample(torch.cat([torch.randn(1, 50), logits]), [other, state])[1]
    assert batched == alone[0]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.7])
    state = SamplerState(SamplingParams(temperature=1.0, seed=0))
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(probs.log()[None], [state])[0]] += 1
    torch.testing.assert_close(counts / 3000, probs, atol=0.03, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_tokens": 0}, "max_tokens=0"), ({"temperature": -1}, "temperature=-1"),
     ({"top_p": 0.0}, "top_p=0.0"), ({"top_k": -2}, "top_k=-2")],
)  # fmt: skip
def test_bad_params_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)

"""Logprobs in the engine: the batched records against a plain log_softmax, against
transformers' float32 logits through chunked prefill (prompt logprobs) and speculation
(a speculating engine's logprobs equal a plain one's), and penalties with drafts."""

from __future__ import annotations

import pytest
import torch

from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.logprobs import token_logprobs
from vlmserve.sample.params import SamplingParams

ALWAYS = SpeculativeConfig(num_speculative_tokens=4, min_n=1, adaptive=False)
PROMPT = "the red star is on the left of the blue circle " * 3


def make_engine(path, spec: SpeculativeConfig | None = None, budget: int = 8) -> Engine:
    return Engine(
        EngineConfig(
            ModelConfig(str(path)),
            CacheConfig(num_blocks=256, block_size=4),
            SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16),
            speculative=spec or SpeculativeConfig(),
        )
    )


def test_token_logprobs_equal_a_plain_log_softmax():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 4
    rows, tokens, tops = [4, 0, 2], [7, 299, 13], [0, 3, 20]
    records = token_logprobs(logits.bfloat16().float(), rows, tokens, tops)
    reference = torch.log_softmax(logits.bfloat16().float(), -1)
    for record, row, token, k in zip(records, rows, tokens, tops, strict=True):
        assert record.token_id == token
        assert abs(record.logprob - float(reference[row, token])) < 1e-6
        assert record.rank == 1 + int((reference[row] > reference[row, token]).sum())
        values, ids = reference[row].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in record.top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in record.top]), values)


@pytest.fixture(scope="module")
def hf_llama(llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(
        llama_path
    ).float().eval(), AutoTokenizer.from_pretrained(llama_path)


def test_prompt_and_output_logprobs_through_chunked_prefill_equal_transformers(
    llama_path, hf_llama
):
    """A budget of 8 tokens cuts the prompt into chunks: each chunk's rows are scored."""
    model, tokenizer = hf_llama
    ids = tokenizer(PROMPT).input_ids
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=4,
                            prompt_logprobs=2)  # fmt: skip
    [out] = make_engine(llama_path).generate([Request(prompt=PROMPT, sampling=params)])
    full = ids + out.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position in range(1, len(ids)):
        record = out.prompt_logprobs[position]
        assert record.token_id == ids[position]
        assert abs(record.logprob - float(reference[position - 1, ids[position]])) < 1e-5
        assert [t for t, _ in record.top] == reference[position - 1].topk(2).indices.tolist()
    assert [r.token_id for r in out.logprobs] == out.token_ids
    for i, record in enumerate(out.logprobs):
        row = reference[len(ids) - 1 + i]
        assert record.rank == 1  # greedy
        torch.testing.assert_close(torch.tensor([v for _, v in record.top]), row.topk(4).values,
                                   atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.slow
def test_speculation_keeps_logprobs_and_penalties(llama_path):
    """Drafted rows score the tokens they emit, and penalise with the drafts before them
    as output: a speculating engine answers as a plain one, logprobs included. (Small
    penalties: larger ones stop the repeats n-gram drafts need; test_controls checks the
    drafted rows' penalties exactly.)"""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2,
                            frequency_penalty=0.01, repetition_penalty=1.01)  # fmt: skip
    requests = lambda: [Request(prompt=PROMPT, sampling=params)]  # noqa: E731
    [plain] = make_engine(llama_path, budget=64).generate(requests())
    engine = make_engine(llama_path, ALWAYS, budget=64)
    [spec] = engine.generate(requests())
    assert engine.spec_metrics.num_proposed_tokens > 0
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4

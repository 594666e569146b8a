"""Structured outputs in the engine (xgrammar): the step's bitmask against the matcher's own
token-by-token verdicts, drafts masked per position, and the engine's constrained output
the same whether it steps in turn, asynchronously, speculating or preempting; compile
failures and timeouts fail the request alone with a 400, never a hang."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

pytest.importorskip("xgrammar")  # structured outputs: skip where it is not installed

import xgrammar as xgr
from transformers import AutoTokenizer

from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.grammar import GrammarError, Grammars
from vlmserve.sample.masks import advance_grammars, constrain_logits
from vlmserve.sample.params import SamplerState, SamplingParams
from vlmserve.sample.sampler import RowGroup
from vlmserve.sample.structured import StructuredConfig, StructuredOutput
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

VOCAB = 384
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["red", "blue", "star"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "size", "kind", "tags"],
}
# Repeats so the n-gram proposer finds drafts (some of which the grammar refuses).
PROMPT = '{"name": "red", "size": 7, "kind": "red", "tags": []} ' * 3 + "red star red star"


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    return make_text_checkpoint(
        tmp_path_factory.mktemp("llama_bytes"), "llama", vocab=VOCAB, tokenizer="bytes"
    )


@pytest.fixture(scope="module")
def grammars(byte_llama):
    tokenizer = AutoTokenizer.from_pretrained(byte_llama)
    g = Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id])
    yield g
    g.close()


def make_engine(
    path, *, spec=0, async_=False, num_blocks=512, structured=None, admission="lumpy"
) -> Engine:
    return Engine(
        EngineConfig(
            ModelConfig(str(path)),
            CacheConfig(num_blocks=num_blocks, block_size=4),
            SchedulerConfig(
                max_num_batched_tokens=64,
                max_num_seqs=8,
                async_scheduling=async_,
                admission=admission,
            ),  # fmt: skip
            speculative=SpeculativeConfig(num_speculative_tokens=spec, adaptive=False),
            structured=structured or StructuredConfig(),
        )
    )


def constrained(seed: int | None, temperature: float, spec: StructuredOutput, **kw):
    params = SamplingParams(
        max_tokens=160, temperature=temperature, seed=seed, structured=spec, **kw
    )
    return Request(prompt=f"{seed} {PROMPT}", sampling=params)  # distinct: no shared prefix


def allowed_by_matcher(matcher: xgr.GrammarMatcher, vocab: int) -> torch.Tensor:
    """The reference: token t is allowed iff the matcher accepts it (then rolled back)."""
    allowed = torch.zeros(vocab, dtype=torch.bool)
    for token in range(vocab):
        if matcher.accept_token(token):
            allowed[token] = True
            matcher.rollback(1)
    return allowed


def test_bitmask_equals_the_matchers_verdicts(grammars):
    grammar = grammars.request(StructuredOutput.json_schema(SCHEMA))
    grammar.future.result()
    assert grammar.ready()
    state = SamplerState(SamplingParams())
    state.grammar = grammar
    free = SamplerState(SamplingParams())  # an unconstrained row beside it
    gen = torch.Generator().manual_seed(0)
    text = '{"name": "ab", "size": 12, "kind": "star", "tags": ["x"]}'
    tokenizer = AutoTokenizer.from_pretrained(grammars._tokenizer.name_or_path)
    for token in tokenizer(text)["input_ids"]:
        logits = torch.randn(2, VOCAB, generator=gen)
        before = logits.clone()
        dead = constrain_logits(logits, [RowGroup(free, 0), RowGroup(state, 1)])
        assert not dead
        assert torch.equal(logits[0], before[0])  # the unconstrained row is untouched
        reference = allowed_by_matcher(grammar.matcher, VOCAB)
        assert torch.equal(torch.isfinite(logits[1]), reference)
        assert torch.equal(logits[1][reference], before[1][reference])
        assert grammar.matcher.accept_token(token)
    assert grammar.matcher.is_completed()


def test_drafts_are_masked_per_position_and_rolled_back(grammars):
    grammar = grammars.request(StructuredOutput.regex("ab[cd]e"))
    grammar.future.result()
    grammar.ready()
    tokenizer = AutoTokenizer.from_pretrained(grammars._tokenizer.name_or_path)
    a, b, x, c = (tokenizer.convert_tokens_to_ids(t) for t in "abxc")
    state = SamplerState(SamplingParams())
    state.grammar = grammar
    logits = torch.zeros(4, VOCAB)
    constrain_logits(logits, [RowGroup(state, 0, (a, b, x))])
    for k in range(3):  # row k: what the grammar allows after drafts[:k]
        reference = xgr.GrammarMatcher(grammar.future.result())
        assert all(reference.accept_token(t) for t in (a, b, x)[:k])
        assert torch.equal(torch.isfinite(logits[k]), allowed_by_matcher(reference, VOCAB))
    assert torch.isfinite(logits[2, c]) and not torch.isfinite(logits[2, x])  # "x" is refused
    assert torch.isfinite(logits[3]).all()  # past the refused draft: unused, untouched
    assert grammar.matcher.accept_token(a)  # rolled back to the start


def test_batched_advance_tracks_each_matcher_to_its_end(grammars):
    # The rows that emitted one token advance in one call, and termination is booked
    # without asking the matcher: it must agree with the matcher. A stop token ends the
    # grammar, a token after the end (async scheduling's extra one) is ignored, a refused
    # token fails its row alone, and a speculating row's tokens go in one by one.
    tokenizer = AutoTokenizer.from_pretrained(grammars._tokenizer.name_or_path)
    a, b, c = (tokenizer.convert_tokens_to_ids(t) for t in "abc")
    eos = tokenizer.eos_token_id
    states = []
    for pattern in ("ab", "a+", "ab", "ab"):
        grammar = grammars.request(StructuredOutput.regex(pattern))
        grammar.future.result()
        assert grammar.ready() and not grammar.terminated
        state = SamplerState(SamplingParams())
        state.grammar = grammar
        states.append(state)
    free = SamplerState(SamplingParams())  # unconstrained: its tokens are fed to no one
    groups = [RowGroup(state, row) for row, state in enumerate([*states, free])]
    steps = [  # per step, what each row emitted (row 3 speculates at step 1)
        [[a], [a], [a], [a], [c]],
        [[b], [a], [c], [b, eos], [c]],
        [[eos], [eos], [a], [a], [c]],
        [[a], [a], [a], [a], [c]],
    ]
    outs = []
    for emitted in steps:
        outs.append(advance_grammars(groups, emitted, {}))
        for state in states:
            assert state.grammar.terminated == state.grammar.matcher.is_terminated()
    assert isinstance(outs[1][2], GrammarError)  # "c" does not continue "a" in "ab"
    assert all(not isinstance(out, Exception) for i, out in enumerate(outs[1]) if i != 2)
    assert [out for i, out in enumerate(outs[3]) if i != 2] == [[a], [a], [a], [c]]  # ignored
    assert [state.grammar.terminated for state in states] == [True, True, False, True]


def test_compiles_are_cached_and_errors_name_the_problem(grammars):
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"q": {"type": "null"}}})
    first, second = grammars.submit(spec), grammars.submit(spec)
    assert first is second
    bad = grammars.request(StructuredOutput.regex("(unclosed"))
    with pytest.raises(ValueError, match="invalid regex: .*parenthesis"):
        bad.future.result()
        bad.ready()


def json_outputs(engine: Engine, requests: list[Request]) -> list[tuple[list[int], str]]:
    outs = engine.generate(requests)
    for out in outs:
        assert out.error is None, out.error
        assert out.finish_reason == "stop", out.text
        json.loads(out.text)  # valid JSON, closed by the grammar
    return [(out.token_ids, out.text) for out in outs]


def test_same_output_in_turn_async_speculating_and_preempted(byte_llama):
    spec = StructuredOutput.json_schema(SCHEMA)
    sampled = [constrained(seed, 1.0, spec) for seed in range(6)]
    greedy = [
        constrained(None, 0.0, spec),
        constrained(None, 0.0, StructuredOutput.regex("r[a-e]{3,9}d")),
    ]
    base = make_engine(byte_llama)
    expected = json_outputs(base, sampled)
    assert len({text for _, text in expected}) > 3  # seeds give different objects
    expected_greedy = base.generate(greedy)
    assert json_outputs(make_engine(byte_llama, async_=True), sampled) == expected
    # FCFS reserves only the prompt: 6 requests of ~110 tokens and 70 blocks of 4 tokens
    # thrash the pool (preempted ones recompute their KV and keep their tokens).
    small = make_engine(byte_llama, num_blocks=70, admission="fcfs")
    assert json_outputs(small, sampled) == expected
    assert small.scheduler.num_preemptions > 0
    # Speculation: greedy is exact, so the tokens match; drafts the grammar refuses are
    # rejected in verification.
    speculating = make_engine(byte_llama, spec=3)
    outs = speculating.generate(greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected_greedy]
    assert re.fullmatch("r[a-e]{3,9}d", outs[1].text)
    metrics = speculating.spec_metrics
    assert metrics.num_proposed_tokens > metrics.num_accepted_tokens > 0
    # Sampling while speculating: every answer still valid.
    json_outputs(speculating, sampled)


def test_ignore_eos_still_ends_at_the_grammars_end(byte_llama):
    engine = make_engine(byte_llama)
    [out] = engine.generate(
        [constrained(1, 1.0, StructuredOutput.choice(["x", "y"]), ignore_eos=True)]
    )
    assert out.finish_reason == "stop" and out.text in ("x", "y")


def test_compile_timeout_fails_the_request_alone(byte_llama):
    engine = make_engine(byte_llama, structured=StructuredConfig(compile_timeout_s=0.2))
    release = threading.Event()
    pool = engine.grammars.get()
    blockers = [pool._pool.submit(release.wait) for _ in range(pool.config.num_compile_threads)]
    try:
        outs = engine.generate(
            [constrained(0, 1.0, StructuredOutput.regex("slow[0-9]")),
             Request(prompt="red star", sampling=SamplingParams(max_tokens=4, seed=0))]
        )  # fmt: skip
    finally:
        release.set()
        [b.result() for b in blockers]
    assert outs[0].finish_reason == "error" and outs[0].error_status == 400
    assert "took longer than 0.2 s" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 4


def test_a_vocabulary_that_cannot_write_the_grammar_is_a_400(llama_path):
    engine = make_engine(llama_path)  # word-level tokenizer: no "{" token
    [out] = engine.generate([constrained(0, 1.0, StructuredOutput.json_object())])
    assert out.finish_reason == "error" and out.error_status == 400
    assert "vocabulary" in out.error
    assert not engine.has_unfinished()


def test_n_children_each_follow_the_grammar_alone(byte_llama):
    # Each of n children walks its own matcher over the one compiled grammar: a matcher
    # shared by the children would be advanced by every child's tokens.
    regex = "r[a-e]{3,9}d"
    outs = make_engine(byte_llama).generate(
        [constrained(5, 1.0, StructuredOutput.regex(regex), n=4)]
    )
    assert len(outs) == 4 and len({o.text for o in outs}) > 1  # seeds 5..8 differ
    for out in outs:
        assert out.error is None and re.fullmatch(regex, out.text), out.text

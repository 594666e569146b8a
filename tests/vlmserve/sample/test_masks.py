"""A step's grammar masks (vlmserve/sample/masks.py): the fill shared out in chunks between
the fill threads and the sampling thread equals each matcher's own fill, row by row, step
after step in reused buffers; a chunk that fails fails the step's result, not the next."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")  # structured outputs: skip where it is not installed

import xgrammar as xgr
from transformers import AutoTokenizer

from vlmserve.sample import masks
from vlmserve.sample.grammar import Grammars
from vlmserve.sample.params import SamplerState, SamplingParams
from vlmserve.sample.sampler import RowGroup
from vlmserve.sample.structured import StructuredOutput
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

VOCAB = 384
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "size": {"type": "integer"}},
    "required": ["name", "size"],
}
TEXT = '{"name": "ab", "size": 12}'


@pytest.fixture(scope="module")
def tokenizer_and_grammars(tmp_path_factory):
    path = make_text_checkpoint(
        tmp_path_factory.mktemp("llama_bytes"), "llama", vocab=VOCAB, tokenizer="bytes"
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    grammars = Grammars(tokenizer, VOCAB, [tokenizer.eos_token_id])
    yield tokenizer, grammars
    grammars.close()


def constrained_state(grammars: Grammars, spec: StructuredOutput, prefix: list[int]):
    grammar = grammars.request(spec)
    grammar.future.result()
    assert grammar.ready()
    grammar.accept(prefix)
    state = SamplerState(SamplingParams())
    state.grammar = grammar
    return state


def reference_row(compiled: xgr.CompiledGrammar, prefix: list[int]) -> torch.Tensor:
    """A fresh matcher's own fill after `prefix`."""
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in prefix)
    row = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(row)
    return row[0]


def test_shared_fill_equals_each_matchers_own_fill(tokenizer_and_grammars):
    tokenizer, grammars = tokenizer_and_grammars
    spec = StructuredOutput.json_schema(SCHEMA)
    compiled = grammars.submit(spec).result()
    tokens = tokenizer(TEXT)["input_ids"]
    assert len(tokens) > 16
    free = SamplerState(SamplingParams())
    for step in range(3):  # reused buffers: each step's rows as fresh
        # 16 rows at points along the text, an unconstrained row among them, and a
        # speculating row (3 drafts: 4 rows).
        groups, prefixes, row = [], [], 0
        for k in range(16):
            if k == 5:
                groups.append(RowGroup(free, row))
                prefixes.append(None)
                row += 1
            prefix = tokens[: (k + step) % (len(tokens) - 3)]
            drafts = tuple(tokens[len(prefix) : len(prefix) + 3]) if k == 9 else ()
            groups.append(RowGroup(constrained_state(grammars, spec, prefix), row, drafts))
            prefixes.append(prefix)
            row += 1 + len(drafts)
        job = masks.start_fill(groups, row, VOCAB)
        assert job.num_chunks > 2  # shared out: several chunks
        filled = job.result()
        listed = dict(filled.filled)
        assert 5 not in listed and len(listed) == 16  # all but the unconstrained group
        for i, (group, prefix) in enumerate(zip(groups, prefixes, strict=True)):
            if prefix is None:
                continue
            drafts = list(group.draft_token_ids)  # all valid: every row is filled
            assert listed[i] == list(range(group.first_row, group.first_row + 1 + len(drafts)))
            for k, r in enumerate(listed[i]):  # row k: after drafts[:k]
                assert torch.equal(filled.bitmask[r], reference_row(compiled, prefix + drafts[:k]))
        logits = torch.zeros(row + 2, VOCAB)  # 2 rows past the sampling ones: untouched
        assert masks.apply_masks(logits, filled) == {}
        assert torch.equal(logits[groups[5].first_row], torch.zeros(VOCAB))
        assert torch.equal(logits[row:], torch.zeros(2, VOCAB))
        assert not torch.isfinite(logits[:row]).all()  # the constrained rows were masked


def test_a_failed_chunk_fails_the_step_not_the_next(tokenizer_and_grammars):
    tokenizer, grammars = tokenizer_and_grammars
    spec = StructuredOutput.choice(["ab"])
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in "ab")
    ended = constrained_state(grammars, spec, [a, b])
    assert ended.grammar.matcher.accept_token(tokenizer.eos_token_id)  # not booked: the
    # matcher has ended but the grammar says it is live, so filling it raises
    with pytest.raises(Exception, match="terminated"):  # xgrammar's error, raised here
        masks.start_fill([RowGroup(ended, 0)], 1, VOCAB).result()
    fine = constrained_state(grammars, spec, [a])
    filled = masks.start_fill([RowGroup(fine, 0)], 1, VOCAB).result()
    assert torch.equal(filled.bitmask[0], reference_row(grammars.submit(spec).result(), [a]))

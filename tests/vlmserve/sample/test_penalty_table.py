"""The penalties' incremental per-request state (`penalty_table.py`) against the plain
per-row reference of `test_controls.py` recomputed from the whole history every step:
over many steps, with drafts (accepted and rejected), with an output list its owner cut or
replaced, with rows recycled from collected requests; and end to end, greedy decoding with
penalties under speculation, async scheduling and preemption equals transformers' logits
run through the reference, every controlled row the engines sample (draft rows included)
equals the reference over its request's kept output, and every row comes back."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from scheduler.config import SpeculativeConfig
from tests import helpers
from tests.vlmserve.sample.test_controls import reference
from vlmserve.inputs.processing import Request
from vlmserve.sample.controls import apply_controls
from vlmserve.sample.params import SamplerState, SamplingParams
from vlmserve.sample.penalty_table import PenaltySlot, table_for
from vlmserve.sample.sampler import RowGroup

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PENALTIES = [
    dict(repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=-0.4),
    dict(frequency_penalty=1.2),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=0.9, logit_bias={3: 2.0}, bad_words=("x",), min_tokens=4),
    dict(logit_bias={1: -3.0}),  # controlled, no penalties: the table's zero row
]


def make_state(seed: int, vocab: int, **kw) -> SamplerState:
    state = SamplerState(SamplingParams(seed=seed, max_tokens=64, **kw))
    gen = torch.Generator().manual_seed(seed)
    state.prompt_token_ids = tuple(torch.randint(0, vocab, (20,), generator=gen).tolist())
    state.output_token_ids = torch.randint(0, vocab, (2,), generator=gen).tolist()
    state.stop_token_ids = (2,)
    if state.params.bad_words:
        state.bad_words_ids = ((5,), (state.output_token_ids[-1], 6), (7, 8, 9))
    return state


def check_step(groups: list[RowGroup], vocab: int, device: str, seed: int) -> None:
    """apply_controls on one step's rows equals the reference over each row's history."""
    num_rows = sum(1 + len(g.draft_token_ids) for g in groups)
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    expected = logits.clone()
    for g in groups:
        for j in range(1 + len(g.draft_token_ids)):
            history = [*g.state.output_token_ids, *g.draft_token_ids[:j]]
            if g.state.params.has_logit_controls:
                expected[g.first_row + j] = reference(logits[g.first_row + j], g.state, history)
    out = apply_controls(logits.to(device), groups).cpu()
    assert torch.equal(out.isinf(), expected.isinf())
    finite = expected.isfinite()
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_counts_follow_the_output_step_by_step_and_rejected_drafts_leave_nothing(device):
    """12 steps of 5 requests, drafts on some: each step's tokens are appended as the
    sampler does (accepted drafts, then one more); rejected drafts are never counted."""
    vocab, rng = 40, random.Random(0)
    states = [make_state(i, vocab, **kw) for i, kw in enumerate(PENALTIES)]
    for step in range(12):
        groups, row = [], 0
        for i, state in enumerate(states):
            drafts = tuple(rng.randrange(vocab) for _ in range(rng.choice([0, 2, 3])))
            if i == 0 and step % 3 == 0:  # repeats: the drafts' own counts matter
                drafts = (4, 4, 4)
            groups.append(RowGroup(state, row, drafts))
            row += 1 + len(drafts)
        check_step(groups, vocab, device, step)
        slot = states[0].penalties  # counted up to the output the step followed
        assert isinstance(slot, PenaltySlot) and slot.num_counted == len(slot.source)
        for g in groups:  # a random number of drafts accepted, then the row's token
            accepted = rng.randrange(len(g.draft_token_ids) + 1)
            g.state.output_token_ids.extend([*g.draft_token_ids[:accepted], rng.randrange(vocab)])
    assert slot.source is states[0].output_token_ids
    assert states[-1].penalties is None  # no penalties: no row of its own


def test_an_output_cut_or_replaced_by_its_owner_is_counted_afresh():
    vocab = 40
    state = make_state(3, vocab, frequency_penalty=1.5, repetition_penalty=1.3)
    state.output_token_ids += [9, 9, 9, 11]
    check_step([RowGroup(state, 0)], vocab, "cpu", 0)
    del state.output_token_ids[-3:]  # rolled back: the 9s it had counted are gone
    check_step([RowGroup(state, 0)], vocab, "cpu", 1)
    state.output_token_ids.append(12)  # and it goes on from there
    check_step([RowGroup(state, 0)], vocab, "cpu", 2)
    state.output_token_ids = [11, 11, 30]  # a new list of the same length as the old
    check_step([RowGroup(state, 0)], vocab, "cpu", 3)


def test_rows_grow_and_rows_of_collected_requests_are_reused_zeroed():
    vocab = 43  # a table of its own (tables are per device and vocabulary size)
    table = table_for(torch.device("cpu"), vocab)
    first = table.num_rows
    states = [make_state(i, vocab, frequency_penalty=2.0, repetition_penalty=1.5)
              for i in range(first + 5)]  # fmt: skip
    for s in states:
        s.output_token_ids += [7] * 6  # heavy counts, to be seen if a row leaked
    check_step([RowGroup(s, i) for i, s in enumerate(states)], vocab, "cpu", 0)
    assert table.num_rows >= first + 6  # grown, the zero row kept
    used = {s.penalties.index for s in states}
    assert 0 not in used and len(used) == len(states)
    del states, s
    gc.collect()
    fresh = [make_state(100 + i, vocab, presence_penalty=1.0, repetition_penalty=1.2)
             for i in range(len(used))]  # fmt: skip
    check_step([RowGroup(s, i) for i, s in enumerate(fresh)], vocab, "cpu", 1)
    assert {s.penalties.index for s in fresh} == used  # recycled, and zeroed (the check)


# -- end to end -----------------------------------------------------------------------------

TEXTS = [
    "the red star is on the left of the blue circle " * 2,
    "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2",
    "how many " * 5,
    "a b c a b c a b c please",
]
CONTROLS = [
    dict(frequency_penalty=1.5, presence_penalty=0.5),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.8, frequency_penalty=-0.3),
    dict(presence_penalty=2.0, bad_words=("the",)),
]
NUM_TOKENS = 24


def requests() -> list[Request]:
    """Greedy ones (compared with the reference), then seeded sampling among 3 tokens:
    n-gram drafts come often and fail often (and a request's tokens are the same sync,
    async and preempted)."""
    greedy = [
        Request(prompt=text, request_id=f"r{i}", sampling=helpers.greedy(NUM_TOKENS, **kw))
        for i, (text, kw) in enumerate(zip(TEXTS, CONTROLS, strict=True))
    ]
    sampled = [
        Request(prompt=text, request_id=f"s{i}", sampling=SamplingParams(
            max_tokens=NUM_TOKENS, top_k=3, seed=i, ignore_eos=True, **kw,
        ))
        for i, (text, kw) in enumerate(zip(TEXTS, CONTROLS, strict=True))
    ]  # fmt: skip
    return greedy + sampled


def reference_tokens(model, prompt_ids: list[int], state: SamplerState) -> list[int]:
    """Greedy over transformers' float32 logits through the plain reference."""
    ids, tokens = list(prompt_ids), []
    state.prompt_token_ids = tuple(prompt_ids)
    for _ in range(NUM_TOKENS):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        tokens.append(int(reference(logits, state, tokens).argmax()))
        ids.append(tokens[-1])
    return tokens


def checking_controls(monkeypatch) -> tuple[list[int], list[str]]:
    """Check every controlled row the engine samples against the reference over its
    request's kept output and the drafts before it (rows checked per draft position,
    mismatches): a step's rejected drafts must not reach the next step's rows."""
    import vlmserve.sample.sampler as sampler_module

    real = sampler_module.apply_controls
    positions, bad = [0] * 8, []

    def checking(logits: torch.Tensor, groups) -> torch.Tensor:
        out = real(logits, groups)
        for g in groups:
            if not g.state.params.has_logit_controls:
                continue
            for j in range(1 + len(g.draft_token_ids)):
                history = [*g.state.output_token_ids, *g.draft_token_ids[:j]]
                want = reference(logits[g.first_row + j].float(), g.state, history)
                got = out[g.first_row + j]
                finite = want.isfinite()
                if not torch.equal(got.isinf(), want.isinf()) or not torch.allclose(
                    got[finite], want[finite], rtol=1e-6, atol=1e-5
                ):
                    bad.append(f"row {j} of {len(g.draft_token_ids)} drafts")
                positions[j] += 1
        return out

    monkeypatch.setattr(sampler_module, "apply_controls", checking)
    return positions, bad


@pytest.mark.slow
def test_penalised_greedy_equals_the_reference_under_speculation_async_and_preemption(
    llama_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from vlmserve.engine.request_options import bad_words_ids

    spec = SpeculativeConfig(num_speculative_tokens=4, min_n=1, adaptive=False)
    fcfs, sync = {"admission": "fcfs"}, {"async_scheduling": False}
    engines = {
        "sync": helpers.make_engine(llama_path, budget=24, scheduler=sync),
        "async": helpers.make_engine(llama_path, budget=24, scheduler={"async_scheduling": True}),
        # FCFS reserves only prompts: a small pool preempts (and recomputes) mid-output.
        "preempted": helpers.make_engine(
            llama_path, num_blocks=26, budget=24, scheduler={**fcfs, "async_scheduling": True}
        ),
        "speculating": helpers.make_engine(llama_path, budget=24, speculative=spec),
    }
    positions, bad = checking_controls(monkeypatch)
    outputs = {name: helpers.run_checked(e, requests()) for name, e in engines.items()}
    assert not bad, bad[:5]
    assert positions[1] >= 10 and positions[3] > 0, positions  # draft rows were checked
    assert engines["async"].async_scheduling
    assert engines["preempted"].scheduler.num_preemptions > 0
    metrics = engines["speculating"].spec_metrics
    assert 0 < metrics.num_accepted_tokens < metrics.num_proposed_tokens  # some rejected
    model = AutoModelForCausalLM.from_pretrained(llama_path).float().eval()
    engine = engines["sync"]
    for request, out in list(zip(requests(), outputs["sync"], strict=True))[: len(TEXTS)]:
        state = SamplerState(request.sampling)
        state.bad_words_ids = bad_words_ids(engine.tokenizer, request.sampling.bad_words)
        want = reference_tokens(model, out.prompt_token_ids, state)
        assert out.token_ids == want, request.request_id
    for name, outs in outputs.items():  # drafts change a sampled request's draws
        num = len(TEXTS) if name == "speculating" else len(outs)
        assert [o.token_ids for o in outs[:num]] == [o.token_ids for o in outputs["sync"][:num]]
    plain = helpers.run_checked(
        helpers.make_engine(llama_path, budget=24, scheduler=sync),
        [Request(prompt=text, sampling=helpers.greedy(NUM_TOKENS)) for text in TEXTS],
    )
    greedy = outputs["sync"][: len(TEXTS)]
    changed = [a.token_ids != b.token_ids for a, b in zip(plain, greedy, strict=True)]
    assert sum(changed) >= 3, changed  # the penalties do change the answers
    # Every finished request gave its row back (row 0 is never handed out).
    table = table_for(engine.runner.device, engine.runner.model.decoder.cfg.vocab_size)
    gc.collect()
    with table.lock:
        table.sync([])
    assert len(table._free) == table.num_rows - 1

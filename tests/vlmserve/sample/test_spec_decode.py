"""n-gram speculation end to end: lossless greedy and sampling, rollback, stop handling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vlmserve.sample.ops as sampling_ops
from scheduler.config import SpeculativeConfig
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import Sequence
from tests import helpers
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint

EMBEDDED = Path(__file__).parents[3] / "vlmserve" / "embedded" / "default_model"
# Always speculate (the ridge is far away, no per-sequence switch-off): the most drafts.
ALWAYS = SpeculativeConfig(num_speculative_tokens=4, min_n=1, adaptive=False)
OFF = SpeculativeConfig(num_speculative_tokens=0)
COPY_HEAVY = [
    "the red star is on the left of the blue circle " * 3,
    "w1 w2 w3 w4 w5 w6 w1 w2 w3 w4 w5 w6 w1 w2",
    "what colour is the star",
    "a b c a b c a b c a b c please tell me",
    "describe this image of a green square and a green square and a",
    "how many " * 6,
]


def make_engine(
    path, spec: SpeculativeConfig | None = None, *, num_blocks=256, budget=24, admission="lumpy"
):
    return helpers.make_engine(
        path, num_blocks=num_blocks, budget=budget, scheduler={"admission": admission},
        speculative=spec or OFF,
    )  # fmt: skip


def run_checked(engine: Engine, requests: list[Request]) -> list:
    """generate(), checking after every step that the block manager is sound and that
    every running sequence holds exactly the blocks of its computed tokens."""
    outputs = [engine._states[engine.add_request(r)].output for r in requests]
    bm = engine.scheduler.block_manager
    while engine.has_unfinished():
        engine.step()
        bm.check_integrity()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens), seq.request_id
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked after the queue drained"
    return outputs


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def text_requests(params: list[SamplingParams]) -> list[Request]:
    return [
        Request(prompt=COPY_HEAVY[i % len(COPY_HEAVY)], sampling=p, request_id=f"r{i}")
        for i, p in enumerate(params)
    ]


@pytest.mark.slow
def test_greedy_with_speculation_equals_without(llama_path):
    params = [greedy(40), greedy(5), greedy(17), greedy(33), greedy(1), greedy(40)] * 2
    first = make_engine(llama_path)
    plain = run_checked(first, text_requests(params))
    # Stop conditions that fall inside accepted runs: a stop id and a stop string taken
    # from the middle of plain outputs, so the plain run stops there too.
    tokenizer = first.tokenizer
    params[0] = greedy(40, stop_token_ids=(plain[0].token_ids[12],))
    params[3] = greedy(33, stop=(tokenizer.decode([plain[3].token_ids[9]]),))
    params[6] = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(1,))
    plain_engine = make_engine(llama_path)
    plain = run_checked(plain_engine, text_requests(params))
    engine = make_engine(llama_path, ALWAYS)
    spec = run_checked(engine, text_requests(params))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    assert plain[0].finish_reason == "stop" and plain[3].finish_reason == "stop"
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(spec, params, strict=True))
    metrics = engine.spec_metrics
    assert metrics.num_accepted_tokens > 20, metrics  # not vacuous: drafts were accepted
    assert metrics.num_accepted_tokens < metrics.num_proposed_tokens  # and some rejected
    assert engine.num_steps < plain_engine.num_steps


@pytest.mark.slow
def test_greedy_with_images_and_adaptive_policy_equals_without(llava_ov_path, random_image):
    def requests():
        out = []
        for i in range(6):
            images = [random_image(20 + i * 2 + j, 30 + 15 * i, 50) for j in range(i % 3)]
            out.append(helpers.chat(images, COPY_HEAVY[i], greedy(6 + 5 * i), request_id=f"v{i}"))
        return out

    plain = run_checked(make_engine(llava_ov_path), requests())
    adaptive = SpeculativeConfig(num_speculative_tokens=4, min_n=1, ridge_batch=64)
    engine = make_engine(llava_ov_path, adaptive)
    spec = run_checked(engine, requests())
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.spec_metrics.num_accepted_tokens > 0


@pytest.mark.slow
def test_greedy_with_speculation_equals_without_on_the_embedded_model():
    from vlmserve.embedded.evaluate import CAPTION_PROMPT, heldout_scenes
    from vlmserve.embedded.scenes import render_scene

    images = [render_scene(s) for s in heldout_scenes(6) + heldout_scenes(2, multi_tile=True)]

    def requests():
        return [helpers.chat([image], CAPTION_PROMPT, greedy(48)) for image in images]

    plain = run_checked(make_engine(EMBEDDED), requests())
    engine = make_engine(EMBEDDED, ALWAYS)
    spec = run_checked(engine, requests())
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # Captions repeat phrases ("... at left, ... at centre"): some drafts must land.
    assert engine.spec_metrics.num_accepted_tokens > 0


@pytest.mark.slow
def test_rejected_drafts_roll_back_and_every_block_returns(llama_path):
    # Sampling among 3 tokens repeats n-grams, so drafts come often and fail often; a small
    # pool adds preemption on top. run_checked checks the block tables after every step.
    params = [SamplingParams(max_tokens=40, top_k=3, seed=i, ignore_eos=True)
              for i in range(16)]  # fmt: skip
    spec = SpeculativeConfig(num_speculative_tokens=6, min_n=1, adaptive=False)
    # FCFS reserves only prompts, so the small pool preempts (lumpy would not).
    engine = make_engine(llama_path, spec, num_blocks=48, admission="fcfs")
    outputs = run_checked(engine, text_requests(params))
    metrics = engine.spec_metrics
    assert metrics.num_proposed_tokens - metrics.num_accepted_tokens > 200, metrics
    assert engine.scheduler.num_preemptions > 0
    assert all(len(o.token_ids) == 40 for o in outputs)
    # The prefix cache holds only blocks of accepted tokens: every cached hash is one of
    # the hash chain of some request's prompt + output.
    bm = engine.scheduler.block_manager
    accepted_hashes = set()
    for request, out in zip(text_requests(params), outputs, strict=True):
        ids = engine.processor.process(request).token_ids + out.token_ids
        accepted_hashes |= set(extend_block_hashes(Sequence("x", ids), len(ids), bm.block_size))
    assert bm._cached and set(bm._cached) <= accepted_hashes


# -- sampling: the output distribution is unchanged ----------------------------------------

VOCAB16 = "<unk> <pad> <s> </s> a an the is are what where how many colour color red".split()
# Every one of the 16 tokens occurs in the prompt, so a draft is proposed at every step.
PROMPT16 = " ".join(VOCAB16[i] for i in [3, 7, 1, 12, 0, 5, 9, 14, 2, 11, 4, 15, 8, 6, 13, 10] * 2)
NUM_SAMPLES = 1000
TEMPERATURE_1 = {"temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vocab16_path(tmp_path_factory):
    """16 tokens, and weights large enough that the next-token distributions are peaked."""
    path = tmp_path_factory.mktemp("vocab16")
    return make_text_checkpoint(path, "llama", vocab=16, initializer_range=0.3)


@pytest.fixture(scope="module")
def plain_samples(vocab16_path):
    """Samples without speculation, by sampling params (shared by the tests below)."""
    cache = {}

    def get(params: dict) -> torch.Tensor:
        key = tuple(sorted(params.items()))
        if key not in cache:
            cache[key] = sample_first_tokens(vocab16_path, OFF, params)
        return cache[key]

    return get


def sample_first_tokens(path, spec: SpeculativeConfig, params: dict) -> torch.Tensor:
    """[NUM_SAMPLES, 4] first tokens of requests with seeds 0..NUM_SAMPLES-1."""
    engine = helpers.make_engine(
        path, num_blocks=2048, budget=1024, max_num_seqs=128, speculative=spec
    )
    requests = [
        Request(prompt=PROMPT16, sampling=SamplingParams(max_tokens=4, seed=i, **params))
        for i in range(NUM_SAMPLES)
    ]
    outputs = engine.generate(requests)
    if spec.enabled:
        assert engine.spec_metrics.num_verifications > NUM_SAMPLES  # drafts were verified
        assert engine.spec_metrics.num_accepted_tokens > 100
    return torch.tensor([o.token_ids for o in outputs])


def homogeneity_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two samples of token ids come from one distribution (bins
    with fewer than 10 samples together are pooled)."""
    counts = torch.stack([torch.bincount(a, minlength=16), torch.bincount(b, minlength=16)])
    counts = counts.double()
    rare = counts.sum(0) < 10
    counts = torch.cat([counts[:, ~rare], counts[:, rare].sum(1, keepdim=True)], dim=1)
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    if dof == 0:  # both samples are one and the same token
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))  # chi2 sf


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [TEMPERATURE_1, {"temperature": 0.7, "top_k": 6, "top_p": 0.9, "ignore_eos": True}],
)
def test_sampling_distribution_is_unchanged_by_speculation(vocab16_path, plain_samples, params):
    spec = SpeculativeConfig(num_speculative_tokens=3, min_n=1, adaptive=False)
    plain = plain_samples(params)
    with_spec = sample_first_tokens(vocab16_path, spec, params)
    # Token 0 comes from the prefill (no drafts yet); tokens 1-3 went through verification.
    for position in range(4):
        p = homogeneity_p_value(plain[:, position], with_spec[:, position])
        assert p > 1e-3, f"position {position}: p = {p:.2e}"


@pytest.mark.slow
def test_the_chi_square_test_catches_a_wrong_acceptance_rule(
    vocab16_path, plain_samples, monkeypatch
):
    """Power check: resampling from p WITHOUT removing the rejected draft (a plausible bug)
    over-produces draft tokens, and the test above must see it."""

    def keep_the_draft(weights, rows, draft_ids):
        pass  # the bug: the draw after a rejection may give the rejected draft again

    plain = plain_samples(TEMPERATURE_1)
    monkeypatch.setattr(sampling_ops, "remove_draft_", keep_the_draft)
    spec = SpeculativeConfig(num_speculative_tokens=3, min_n=1, adaptive=False)
    wrong = sample_first_tokens(vocab16_path, spec, TEMPERATURE_1)
    assert min(homogeneity_p_value(plain[:, i], wrong[:, i]) for i in (1, 2, 3)) < 1e-6


@pytest.mark.slow
def test_adaptive_speculation_never_drafts_for_a_seeded_sampled_request(vocab16_path):
    """Adaptive γ drafts by the load, and a draft changes which token a row's uniforms pick:
    a seeded sampled request gets no drafts, so its tokens are those of an engine without
    speculation, beside greedy requests that are drafted for."""

    def run(spec):
        engine = helpers.make_engine(vocab16_path, budget=256, speculative=spec)
        seeded = [SamplingParams(max_tokens=12, seed=i, **TEMPERATURE_1) for i in range(24)]
        plain = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 8
        outputs = engine.generate([Request(prompt=PROMPT16, sampling=p) for p in seeded + plain])
        return [o.token_ids for o in outputs[: len(seeded)]], engine.spec_metrics

    off, _ = run(OFF)
    adaptive, metrics = run(SpeculativeConfig(num_speculative_tokens=4, min_n=1, ridge_batch=1e6))
    assert metrics.num_proposed_tokens > 0  # the greedy ones were drafted for
    assert adaptive == off

"""One bad request never hurts another: failures inside a step (an image's encode, a
placeholder count, sampling, the forward pass) fail their own requests only, the others
get exactly the tokens they get alone, no KV block leaks, and the engine serves on."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import pytest
import torch

from encoders.errors import ImageDecodeError, PromptTooLongError
from scheduler.config import SpeculativeConfig
from scheduler.step_plan import ScheduledSeq
from tests.helpers import chat, make_engine
from tests.scheduler.sched_testing import RefusesOne
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import MAX_CHARS_PER_TOKEN, Request
from vlmserve.sample.params import SamplerState, SamplingParams
from vlmserve.sample.verify import sample_plan

GREEDY_8 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def drain(engine: Engine, ids: list[str]) -> dict[str, object]:
    """Step until idle; the final output of each id. Checks the block pool each step."""
    outputs = {rid: engine._states[rid].output for rid in ids}
    bm = engine.scheduler.block_manager
    while engine.has_unfinished():
        engine.step()
        bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return outputs


def alone(engine: Engine, request: Request) -> list[int]:
    rid = engine.add_request(dataclasses.replace(request, request_id=None))
    return drain(engine, [rid])[rid].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_image_failing_at_encode_time_fails_only_its_request(
    llava_ov_path, random_image, async_scheduling
):
    engine = make_engine(llava_ov_path, scheduler={"async_scheduling": async_scheduling})
    good = chat([random_image(1, 60, 40)], "describe", GREEDY_8)
    text = Request(prompt="red green blue", sampling=GREEDY_8)
    want = {"good": alone(engine, good), "text": alone(engine, text)}
    engine.runner.encoder_cache.clear()  # the good image must go through the tower again
    bad = engine.prepare(chat([random_image(2, 50, 50)], "describe", GREEDY_8))
    work = bad.prompt.works[0]
    work.embedding, work.future = None, Future()
    work.future.set_exception(ImageDecodeError("cannot decode image: corrupt data"))
    ids = [
        engine.add_request(dataclasses.replace(good, request_id="good")),
        engine.add_request(dataclasses.replace(bad, request_id="bad")),
        engine.add_request(dataclasses.replace(text, request_id="text")),
    ]
    outs = drain(engine, ids)
    assert (outs["bad"].finish_reason, outs["bad"].error_status) == ("error", 400)
    assert "corrupt data" in outs["bad"].error
    assert outs["good"].token_ids == want["good"] and outs["text"].token_ids == want["text"]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_placeholder_count_mismatch_fails_only_its_request(
    llava_ov_path, random_image, async_scheduling
):
    engine = make_engine(llava_ov_path, scheduler={"async_scheduling": async_scheduling})
    good = chat([random_image(3, 40, 60)], "describe", GREEDY_8)
    want = alone(engine, good)
    engine.runner.encoder_cache.clear()
    bad = engine.prepare(chat([random_image(4, 60, 60)], "describe", GREEDY_8))
    image = bad.prompt.images[0]
    bad.prompt.images[0] = dataclasses.replace(image, positions=image.positions[:-1])
    ids = [
        engine.add_request(dataclasses.replace(bad, request_id="bad")),
        engine.add_request(dataclasses.replace(good, request_id="good")),
    ]
    outs = drain(engine, ids)
    assert (outs["bad"].finish_reason, outs["bad"].error_status) == ("error", 500)
    assert "placeholders" not in outs["bad"].error  # internals stay in the log
    assert outs["good"].token_ids == want


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failed_forward_pass_fails_its_step_and_the_engine_serves_on(
    llama_path, async_scheduling
):
    engine = make_engine(llama_path, scheduler={"async_scheduling": async_scheduling})
    assert engine.async_scheduling == async_scheduling
    request = Request(prompt="one two three four", sampling=GREEDY_8)
    want = alone(engine, request)
    # A third request joins a step later, so the failing step is not its own: with async
    # scheduling its first step is launched before the failure is known.
    late = Request(prompt="five six seven", sampling=GREEDY_8)
    want_late = alone(engine, late)
    ids = [engine.add_request(dataclasses.replace(request, request_id=f"r{i}")) for i in (1, 2)]
    outs = {rid: engine._states[rid].output for rid in ids}
    run = engine.runner.run

    def out_of_memory_once(inputs, previous=None, greedy=False):
        engine.runner.run = run
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine.runner.run = out_of_memory_once
    engine.step()  # the failing step (launched only, when async)
    outs |= drain(engine, [engine.add_request(dataclasses.replace(late, request_id="late"))])
    for rid in ids:
        assert (outs[rid].finish_reason, outs[rid].error_status) == ("error", 500)
        assert "out of memory" not in outs[rid].error
    assert outs["late"].token_ids == want_late
    assert alone(engine, request) == want


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_sampling_that_raises_in_a_step_fails_only_its_request(llama_path, async_scheduling):
    engine = make_engine(llama_path, scheduler={"async_scheduling": async_scheduling})
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    prompts = [("one two three", GREEDY_8), ("red green", seeded), ("blue star", GREEDY_8)]
    requests = [Request(prompt=p, sampling=s) for p, s in prompts]
    want = [alone(engine, r) for r in requests]
    ids = [engine.add_request(dataclasses.replace(r, request_id=f"r{i}"))
           for i, r in enumerate(requests)]  # fmt: skip
    for _ in range(3):
        engine.step()
    engine._states["r1"].sampler.rng = "broken"  # its uniforms cannot be drawn from now on
    outs = drain(engine, ids)
    assert (outs["r1"].finish_reason, outs["r1"].error_status) == ("error", 500)
    assert outs["r0"].token_ids == want[0] and outs["r2"].token_ids == want[2]


def test_temperatures_and_top_p_that_underflow_sample_like_greedy(llama_path):
    engine = make_engine(llama_path)
    prompt = "one two three four five"
    params = [
        GREEDY_8,
        SamplingParams(max_tokens=8, temperature=1e-40, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-300, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True),
    ]
    ids = [
        engine.add_request(Request(prompt=prompt, sampling=p, request_id=str(i)))
        for i, p in enumerate(params)
    ]
    outs = drain(engine, ids)
    assert all(outs[rid].error is None and len(outs[rid].token_ids) == 8 for rid in ids)
    assert outs["1"].token_ids == outs["0"].token_ids == outs["2"].token_ids


def test_sampling_that_raises_fails_only_its_row():
    def item(rid: str) -> ScheduledSeq:
        return ScheduledSeq(rid, 2, 1, True, (3,))

    logits = torch.randn(3, 11)
    logits[1] = float("nan")  # a broken row: multinomial refuses it
    states = [SamplerState(SamplingParams(temperature=1.0, seed=s)) for s in (7, 8, 9)]
    sampled = sample_plan([item("a"), item("b"), item("c")], logits, states)
    assert isinstance(sampled[1], Exception)
    # The others drew exactly what they draw alone with the same seeds.
    for i in (0, 2):
        seed = 7 + i
        state = SamplerState(SamplingParams(temperature=1.0, seed=seed))
        assert sampled[i] == sample_plan([item("x")], logits[i : i + 1], [state])[0]


def test_stats_with_speculation_on(llama_path):
    spec = SpeculativeConfig(num_speculative_tokens=3, adaptive=False)
    engine = make_engine(llama_path, speculative=spec)
    rid = engine.add_request(Request(prompt="a b a b a b a b a b", sampling=GREEDY_8))
    drain(engine, [rid])
    stats = engine.stats()
    assert stats["spec_proposed"] > 0 and 0 <= stats["spec_accepted"] <= stats["spec_proposed"]


def test_a_cache_hit_pinned_at_prepare_survives_eviction(idefics3_path, random_image):
    engine = make_engine(idefics3_path)
    request = chat([random_image(5, 70, 50)], "describe", GREEDY_8)
    want = alone(engine, request)
    stage = engine.runner.encoder_stage
    prepared = engine.prepare(request)  # the cache holds the image: pinned
    engine.runner.encoder_cache.clear()  # evicted before the step runs
    before = stage.num_tower_images
    rid = engine.add_request(prepared)
    assert drain(engine, [rid])[rid].token_ids == want
    assert stage.num_tower_images == before, "the evicted hit went through the tower again"


def test_a_prompt_that_cannot_fit_is_refused_before_tokenising(llama_path):
    engine = make_engine(llama_path, max_model_len=64)
    huge = "word " * (64 * MAX_CHARS_PER_TOKEN // 5 + 1)
    with pytest.raises(PromptTooLongError, match="characters"):
        engine.prepare(Request(prompt=huge, sampling=GREEDY_8))
    with pytest.raises(PromptTooLongError, match="characters"):
        engine.prepare(Request(messages=[{"role": "user", "content": huge}]))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("admission", ["fcfs", "lumpy"])
def test_a_request_that_never_starts_fails_and_the_others_finish(
    llama_path, admission, async_scheduling
):
    """Nothing running, every waiting request ready, and still no step: the engine fails
    the request it cannot start (500) instead of spinning on it forever. FCFS: nobody
    passes, so the stuck first request holds the queue, and the request queued behind it
    starts only once that one failed, then runs as it runs alone. Lumpy: the request behind
    it overtakes at once and finishes first; the stuck one fails once the engine is idle."""
    engine = make_engine(
        llama_path, scheduler={"async_scheduling": async_scheduling, "admission": admission}
    )
    text = Request(prompt="red green blue", sampling=GREEDY_8)
    want = alone(engine, text)
    engine.scheduler.admission = RefusesOne(engine.scheduler.admission)
    ids = [
        engine.add_request(dataclasses.replace(text, request_id="bad")),
        engine.add_request(dataclasses.replace(text, request_id="text")),
    ]
    outputs = {rid: engine._states[rid].output for rid in ids}
    bad_failed_at = text_first_at = text_done_at = None
    max_wait = engine.config.scheduler.max_wait_steps
    for step in range(max_wait + 40):  # bounded: no hang here
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id == "bad" and out.finished:
                bad_failed_at = step
            if out.request_id == "text" and out.token_ids and text_first_at is None:
                text_first_at = step
            if out.request_id == "text" and out.finished:
                text_done_at = step
    assert not engine.has_unfinished()
    assert outputs["bad"].error_status == 500 and outputs["bad"].token_ids == []
    assert outputs["text"].error is None and outputs["text"].token_ids == want
    assert None not in (bad_failed_at, text_first_at, text_done_at)
    if admission == "fcfs":  # the queue was held: "text" waited out the aging bound
        assert max_wait < bad_failed_at < text_first_at
    else:  # "text" overtook and finished before the engine went idle on "bad"
        assert text_done_at < bad_failed_at
        assert bad_failed_at > text_done_at + max_wait
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks

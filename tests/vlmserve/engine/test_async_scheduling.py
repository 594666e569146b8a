"""Async scheduling end to end: the same tokens as synchronous stepping (greedy and
seeded sampling) over batching, preemption, the prefix cache, speculation, stops and
failures; the extra token of a request that stopped is never emitted and its blocks
come back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scheduler.config import SpeculativeConfig
from tests.helpers import chat, make_engine, run_checked
from tests.vlmserve.engine.test_engine import mixed_requests
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams

SYNC = {"async_scheduling": False}
ASYNC = {"async_scheduling": True}
OFF = SpeculativeConfig(num_speculative_tokens=0)
TEXTS = [
    "the red star is on the left of the blue circle",
    "w1 w2 w3 w4 w5 w6 w1 w2 w3",
    "what colour is the star",
    "how many squares are there in the picture",
    "describe this image of a green square",
    "a b c a b c please tell me",
]


def both(path, requests, **engine_kw) -> tuple[list, list, Engine]:
    """(sync outputs, async outputs, the async engine) of the same requests."""
    sync = run_checked(make_engine(path, scheduler=SYNC, **engine_kw), requests())
    engine = make_engine(path, scheduler=ASYNC, **engine_kw)
    assert engine.async_scheduling
    return sync, run_checked(engine, requests()), engine


def same(a: list, b: list) -> None:
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    assert [o.text for o in b] == [o.text for o in a]
    assert [o.finish_reason for o in b] == [o.finish_reason for o in a]


def count_rows(engine: Engine) -> list[int]:
    """Counts the query rows every forward computes (into the returned one-item list)."""
    rows, run = [0], engine.runner.run

    def counted(inputs, previous=None, greedy=False):
        rows[0] += inputs.token_ids.numel()
        return run(inputs, previous, greedy)

    engine.runner.run = counted
    return rows


@pytest.mark.slow
def test_mixed_batch_of_images_and_chunked_prefills_gives_the_sync_tokens(
    llava_ov_path, random_image
):
    sync, fast, engine = both(llava_ov_path, lambda: mixed_requests(random_image), budget=24)
    same(sync, fast)
    assert engine.times.wait_s > 0 and engine.times.forward_s > 0


@pytest.mark.slow
def test_preemption_under_a_tiny_pool_gives_the_sync_tokens(llava_ov_path, random_image):
    fcfs = {"admission": "fcfs"}
    reference = run_checked(
        make_engine(llava_ov_path, budget=64, scheduler={**SYNC, **fcfs}),
        mixed_requests(random_image),
    )
    engine = make_engine(llava_ov_path, num_blocks=60, budget=64, scheduler={**ASYNC, **fcfs})
    squeezed = run_checked(engine, mixed_requests(random_image))
    same(reference, squeezed)
    assert engine.scheduler.num_preemptions > 0


def test_second_question_about_an_image_still_hits_the_prefix_cache(llava_ov_path, random_image):
    image = random_image(7, 80, 50)
    engine = make_engine(llava_ov_path, budget=512, scheduler=ASYNC)
    run_checked(engine, [chat([image], "what colour is the star")])
    [second] = run_checked(engine, [chat([image], "how many circles are there")])
    assert second.num_cached_tokens >= second.num_image_tokens > 0
    sync = make_engine(llava_ov_path, budget=512, scheduler=SYNC)
    [fresh] = run_checked(sync, [chat([image], "how many circles are there")])
    assert second.token_ids == fresh.token_ids


@pytest.mark.slow
def test_seeded_sampling_gives_the_sync_tokens(llama_path):
    def requests():
        return [
            Request(prompt=text, request_id=f"s{i}", sampling=SamplingParams(
                max_tokens=6 + 3 * i, temperature=0.9, top_k=20, top_p=0.95, seed=i,
                ignore_eos=True,
            ))
            for i, text in enumerate(TEXTS)
        ]  # fmt: skip

    sync, fast, _ = both(llama_path, requests, budget=16)
    same(sync, fast)


@pytest.mark.slow
def test_stops_are_seen_a_step_late_and_the_extra_token_is_never_emitted(llama_path):
    def requests(params: list[SamplingParams]):
        return lambda: [
            Request(prompt=t, sampling=p, request_id=f"r{i}")
            for i, (t, p) in enumerate(zip(TEXTS, params, strict=True))
        ]

    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(TEXTS)
    plain = run_checked(make_engine(llama_path, scheduler=SYNC), requests(greedy)())
    tokenizer = make_engine(llama_path, scheduler=SYNC).tokenizer
    # Stops that fire mid-output: a stop id, a stop string, a stop id that is also the
    # last token max_tokens allows (nothing wasted there), and plain max_tokens.
    at0, at3 = first_new(plain[0].token_ids, 5), first_new(plain[3].token_ids, 3)
    params = [
        dataclasses.replace(greedy[0], stop_token_ids=(plain[0].token_ids[at0],)),
        dataclasses.replace(greedy[1], stop=(tokenizer.decode([plain[1].token_ids[8]]),)),
        dataclasses.replace(greedy[2], max_tokens=7),
        dataclasses.replace(
            greedy[3], stop_token_ids=(plain[3].token_ids[at3],), max_tokens=at3 + 1
        ),
        dataclasses.replace(greedy[4], stop_token_ids=(plain[4].token_ids[0],)),
        greedy[5],
    ]
    # Rows are counted: the sync engine without its default drafts (async runs without).
    sync_engine = make_engine(llama_path, scheduler=SYNC, speculative=OFF)
    engine = make_engine(llama_path, scheduler=ASYNC)
    sync_rows, async_rows = count_rows(sync_engine), count_rows(engine)
    sync = run_checked(sync_engine, requests(params)())
    fast = run_checked(engine, requests(params)())
    same(sync, fast)
    assert [o.finish_reason for o in fast] == ["stop", "stop", "length", "stop", "stop", "length"]
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(fast, params, strict=True))
    assert len(fast[0].token_ids) == at0 + 1 and len(fast[3].token_ids) == at3 + 1
    # One row computed for nothing per request that stopped before its max_tokens.
    early = [o.finish_reason == "stop" and len(o.token_ids) < p.max_tokens
             for o, p in zip(fast, params, strict=True)]  # fmt: skip
    assert early == [True, True, False, False, True, False]
    assert async_rows[0] - sync_rows[0] == 3


def first_new(token_ids: list[int], start: int) -> int:
    """The first index from `start` whose token does not occur before it."""
    return next(i for i in range(start, len(token_ids)) if token_ids[i] not in token_ids[:i])


def test_speculation_falls_back_to_sync_and_keeps_its_tokens(llama_path):
    requests = [Request(prompt=t + " " + t, sampling=SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True)) for t in TEXTS]  # fmt: skip
    spec = make_engine(
        llama_path,
        max_num_seqs=64,
        scheduler={"async_scheduling": True},
        speculative=SpeculativeConfig(num_speculative_tokens=3, min_n=1, adaptive=False),
    )
    assert not spec.async_scheduling  # drafts need the tokens of the step before
    with_spec = run_checked(spec, requests)
    plain = run_checked(make_engine(llama_path, scheduler=ASYNC), requests)
    same(plain, with_spec)
    assert spec.spec_metrics.num_accepted_tokens > 0


def test_abort_while_its_step_is_in_flight_frees_its_blocks(llama_path):
    def requests():
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return [Request(prompt=t, sampling=params, request_id=f"r{i}") for i, t in enumerate(TEXTS)]

    reference = run_checked(make_engine(llama_path, scheduler=SYNC), requests())
    engine = make_engine(llama_path, scheduler=ASYNC)
    outputs = [engine._states[engine.add_request(r)].output for r in requests()]
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    aborted = engine.abort("r2")
    num_tokens = len(aborted.token_ids)
    bm = engine.scheduler.block_manager
    while engine.has_unfinished():
        engine.step()
        bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == num_tokens
    assert num_tokens < 12
    for i, out in enumerate(outputs):
        if i != 2:
            assert out.token_ids == reference[i].token_ids


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_inputs_built_on_the_host_move_to_the_device_whole(llava_ov_path, random_image, backend):
    """`prepare` builds host tensors; `run` moves the attention metadata to a device with
    `_to_device` (on a GPU). Moving it (here to the CPU itself) keeps every field."""
    from vlmserve.worker.runner import _to_device

    engine = make_engine(llava_ov_path, budget=24, attention_backend=backend)
    for request in mixed_requests(random_image)[:4]:
        engine.add_request(request)
    plan = engine.scheduler.schedule()
    assert not engine.runner.encode_images(plan)
    inputs = engine.runner.prepare(plan)
    moved = _to_device(inputs.metadata, torch.device("cpu"))
    assert type(moved) is type(inputs.metadata)
    for name, value in vars(inputs.metadata).items():
        assert repr(getattr(moved, name)) == repr(value), name
    logits = engine.runner.run(inputs)
    assert torch.equal(engine.runner.run(dataclasses.replace(inputs, metadata=moved)), logits)

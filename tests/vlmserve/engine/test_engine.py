"""The engine against transformers, and its batching, prefix cache and preemption."""

from __future__ import annotations

import pytest
import torch

from encoders.errors import (
    ImageDecodeError,
    PromptTooLongError,
    RequestError,
    TooManyImagesError,
)
from tests.helpers import GREEDY_32, chat, make_engine, run_checked
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams


def hf_greedy(path, family: str, images, text: str, max_new_tokens: int = 32) -> list[int]:
    from transformers import (
        AutoProcessor,
        Idefics3ForConditionalGeneration,
        LlavaOnevisionForConditionalGeneration,
    )

    cls = {
        "llava_onevision": LlavaOnevisionForConditionalGeneration,
        "idefics3": Idefics3ForConditionalGeneration,
    }[family]
    model = cls.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}] * len(images)
                 + [{"type": "text", "text": text}]}]  # fmt: skip
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch_images = [images] if family == "idefics3" else images
    inputs = processor(
        text=[prompt], images=batch_images, return_tensors="pt", add_special_tokens=False
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(
    ("family", "sizes"),
    [  # one case per family in the fast lane
        pytest.param("llava_onevision", [(90, 50)], marks=pytest.mark.slow),  # anyres, unpadding
        ("llava_onevision", [(40, 40), (100, 30)]),  # multi-image: base tile + newline each
        ("idefics3", [(70, 45)]),
        pytest.param("idefics3", [(33, 90), (64, 64)], marks=pytest.mark.slow),
    ],
)
def test_greedy_matches_transformers(family, sizes, request, random_image):
    path = request.getfixturevalue(
        "llava_ov_path" if family == "llava_onevision" else "idefics3_path"
    )
    images = [random_image(i, w, h) for i, (w, h) in enumerate(sizes)]
    text = "what colour is the star on the left"
    ref_ids, ref_tokens = hf_greedy(path, family, images, text)
    engine = make_engine(path)
    assert engine.processor.process(chat(images, text)).token_ids == ref_ids
    [out] = run_checked(engine, [chat(images, text)])
    assert len(ref_tokens) == 32
    assert out.token_ids == ref_tokens
    assert out.num_image_tokens == sum(ref_ids[p] == engine.runner.model.image_token_id
                                       for p in range(len(ref_ids)))  # fmt: skip


@pytest.mark.parametrize(
    "eager", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fused-packed", "eager"]
)
def test_text_only_llama_gqa_matches_transformers(llama_path, eager):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(llama_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    prompt = "describe the picture of a red star on the left " * 3
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
    engine = make_engine(llama_path, budget=8, pack_weights=not eager, fused_ops=not eager)
    assert engine.runner.model.decoder.fused is not eager
    [out] = run_checked(engine, [Request(prompt=prompt, sampling=GREEDY_32)])
    assert out.token_ids == ref


def mixed_requests(random_image) -> list[Request]:
    """8 requests: different prompt lengths, image counts and sizes, max_tokens."""
    words = "where is the blue circle and how many squares are there".split()
    requests = []
    for i in range(8):
        images = [random_image(10 + i * 3 + j, 30 + 20 * i, 60 - 4 * i) for j in range(i % 3)]
        params = SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
        text = " ".join(words[: 3 + i])
        requests.append(chat(images, text, params, request_id=f"r{i}"))
    return requests


@pytest.mark.slow
def test_concurrent_requests_match_each_alone(llava_ov_path, random_image):
    alone = []
    for request in mixed_requests(random_image):
        [out] = run_checked(make_engine(llava_ov_path, budget=512), [request])
        alone.append(out.token_ids)
    # Together, with a small dense budget so prefills are chunked across steps and mixed
    # with other requests' decodes.
    together = run_checked(make_engine(llava_ov_path, budget=24), mixed_requests(random_image))
    assert [out.token_ids for out in together] == alone
    assert [len(t) for t in alone] == [4 + 3 * i for i in range(8)]


@pytest.mark.slow
def test_second_question_about_same_image_reuses_its_blocks(llava_ov_path, random_image):
    image = random_image(7, 80, 50)
    engine = make_engine(llava_ov_path, budget=512)
    run_checked(engine, [chat([image], "what colour is the star")])
    before = engine.num_computed_prompt_tokens
    [second] = run_checked(engine, [chat([image], "how many circles are there")])
    computed = engine.num_computed_prompt_tokens - before
    assert second.num_image_tokens > 0
    assert computed <= second.num_prompt_tokens - second.num_image_tokens
    assert second.num_cached_tokens >= second.num_image_tokens
    # Same tokens as without the cache.
    [fresh] = run_checked(make_engine(llava_ov_path), [chat([image], "how many circles are there")])
    assert second.token_ids == fresh.token_ids


@pytest.mark.slow
def test_tiny_kv_pool_preempts_and_still_gives_the_same_tokens(llava_ov_path, random_image):
    reference = run_checked(make_engine(llava_ov_path, budget=64), mixed_requests(random_image))
    # FCFS reserves only the prompt, so the burst of 8 image requests thrashes the pool.
    fcfs = make_engine(llava_ov_path, num_blocks=60, budget=64, scheduler={"admission": "fcfs"})
    squeezed = run_checked(fcfs, mixed_requests(random_image))
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in reference]
    preemptions = fcfs.scheduler.num_preemptions
    assert preemptions > 0, "the pool was meant to be too small to hold every request"
    assert fcfs.stats()["recomputed_tokens_total"] == fcfs.scheduler.num_recomputed_tokens > 0
    # Lumpy reserves prompt + min(max_tokens, decode_reserve_tokens): with max_tokens under
    # the reserve every admitted lump is whole, so the bound is 0 preemptions.
    lumpy = make_engine(llava_ov_path, num_blocks=60, budget=64)
    squeezed = run_checked(lumpy, mixed_requests(random_image))
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in reference]
    assert lumpy.scheduler.num_preemptions == 0
    assert lumpy.stats()["recomputed_tokens_total"] == 0


def test_request_that_can_never_fit_the_pool_is_refused_at_arrival(llava_ov_path, random_image):
    engine = make_engine(llava_ov_path, num_blocks=20)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    with pytest.raises(RequestError, match=r"prompt \+ 60 output tokens\), the KV pool holds 20"):
        engine.add_request(chat([random_image(1, 40, 40)], "describe", params))
    assert not engine.has_unfinished()  # nothing was queued


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_images_still_decoding_are_waited_for_and_a_late_bad_one_fails_alone(
    llava_ov_path, random_image, async_scheduling
):
    from concurrent.futures import Future

    reference = run_checked(make_engine(llava_ov_path), [chat([random_image(1, 40, 40)], "a")])
    engine = make_engine(llava_ov_path, scheduler={"async_scheduling": async_scheduling})
    ids = [
        engine.add_request(chat([random_image(1, 40, 40)], "a", request_id="slow")),
        engine.add_request(chat([random_image(2, 40, 40)], "b", request_id="bad")),
        engine.add_request(chat([random_image(3, 40, 40)], "c", request_id="fine")),
    ]
    seqs = [engine._states[rid].seq for rid in ids]
    slow_work, bad_work = (engine._states[rid].works[0] for rid in ids[:2])
    slow_work.tiles()  # (the real tiles, computed now)
    done, slow_work.future = slow_work.future, Future()  # as if still in the pool
    bad_work.future = Future()
    seqs[0].ready = seqs[1].ready = False
    outputs = {rid: engine._states[rid].output for rid in ids}
    for _ in range(3):
        engine.step()
        assert seqs[0].status == seqs[1].status == "waiting"  # never scheduled
    bad_work.future.set_exception(ImageDecodeError("cannot decode image: truncated"))
    failed = [o for o in engine.step() if o.finish_reason == "error"]
    assert [o.request_id for o in failed] == ["bad"]
    assert failed[0].error_status == 400 and "truncated" in failed[0].error
    slow_work.future = done
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.block_manager.check_integrity()
    assert outputs["slow"].token_ids == reference[0].token_ids
    assert outputs["fine"].finish_reason == "length"


def test_prompt_longer_than_context_names_both_lengths(llama_path):
    engine = make_engine(llama_path, max_model_len=32)
    with pytest.raises(PromptTooLongError, match=r"40 tokens.*context is 32"):
        engine.add_request(Request(prompt="w1 " * 40))


def test_too_many_images_is_rejected(llava_ov_path, random_image):
    engine = make_engine(llava_ov_path, max_images_per_request=2)
    images = [random_image(i, 32, 32) for i in range(3)]
    with pytest.raises(TooManyImagesError, match="3 images, the limit is 2"):
        engine.add_request(chat(images, "describe"))


@pytest.mark.slow
def test_unreadable_image_fails_only_its_request(llava_ov_path, random_image):
    engine = make_engine(llava_ov_path)
    good = [chat([random_image(1, 40, 40)], "describe this", request_id="good-1"),
            chat([b"\xff\xd8\xff\xe0 definitely not a jpeg"], "describe", request_id="bad"),
            chat([random_image(2, 50, 30)], "where is the star", request_id="good-2")]  # fmt: skip
    outputs = engine.generate(good)
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert "cannot decode image" in outputs[1].error
    assert len(outputs[0].token_ids) == 32 and len(outputs[2].token_ids) == 32
    with pytest.raises(ImageDecodeError):
        engine.add_request(chat([b""], "describe"))


@pytest.mark.slow
def test_requests_prepared_on_other_threads_give_the_same_tokens(llava_ov_path, random_image):
    from concurrent.futures import ThreadPoolExecutor

    reference = run_checked(make_engine(llava_ov_path), mixed_requests(random_image))
    engine = make_engine(llava_ov_path, budget=24)
    # Two preparer threads work while the engine steps the requests already added.
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(engine.prepare, r) for r in mixed_requests(random_image)]
        outputs = []
        for future in futures:
            outputs.append(engine._states[engine.add_request(future.result())].output)
            engine.step()
        while engine.has_unfinished():
            engine.step()
            engine.scheduler.block_manager.check_integrity()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]


def test_only_plain_greedy_steps_take_argmaxes():
    from vlmserve.sample.params import SamplerState
    from vlmserve.sample.verify import takes_argmax

    def state(**kw):
        return SamplerState(SamplingParams(max_tokens=4, **{"temperature": 0.0, **kw}))

    assert takes_argmax([state(), state(stop=["x"], seed=3)])
    assert not takes_argmax([])  # nothing samples
    for kw in ({"temperature": 0.7}, {"logprobs": 1}, {"presence_penalty": 0.5},
               {"min_tokens": 2}, {"logit_bias": {5: 1.0}}):  # fmt: skip
        assert not takes_argmax([state(), state(**kw)]), kw
    constrained = state()
    constrained.grammar = object()
    assert not takes_argmax([state(), constrained])


@pytest.mark.parametrize("speculate", [False, True])
def test_greedy_steps_take_the_heads_argmaxes_and_give_the_logits_tokens(
    llama_path, monkeypatch, speculate
):
    """A step of plain greedy requests asks the runner for its rows' argmaxes (the head's
    own where it can: no logits); the tokens are those of the logits and the sampler."""
    import vlmserve.engine.forward_thread as forward_thread
    from scheduler.config import SpeculativeConfig

    always = SpeculativeConfig(num_speculative_tokens=4, min_n=1, adaptive=False)
    spec = always if speculate else None
    prompts = ["one two three one two three one two", "four five six seven", "eight"]

    def generate() -> tuple[list[list[int]], set[bool]]:
        engine = make_engine(llama_path, speculative=spec)
        asked, run = set(), engine.runner.run

        def recorded(inputs, previous=None, greedy=False):
            asked.add(greedy)
            return run(inputs, previous, greedy)

        engine.runner.run = recorded
        outs = run_checked(engine, [Request(prompt=p, sampling=GREEDY_32) for p in prompts])
        return [out.token_ids for out in outs], asked

    argmaxes, asked = generate()
    assert asked == {True}
    monkeypatch.setattr(forward_thread, "takes_argmax", lambda samplers: False)
    logits, asked = generate()
    assert asked == {False}
    assert argmaxes == logits

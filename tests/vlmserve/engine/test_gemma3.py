"""Gemma 3 through the engine against transformers (eager attention, float32): prompts longer
than the sliding window (64), several images and pan-and-scan crops (bidirectional spans),
chunked prefill across the window edge, prefix-cache hits, preemption, async scheduling,
on the default CPU backend (the C++ kernels) and the torch reference. Images go through the
preprocessing pool (layout and token count from the header, tiles from the workers, the
encoder cache keyed by content); `use_pool=False` keeps the HF image processor."""

from __future__ import annotations

import pytest
import torch

from encoders.config import EncoderConfig
from encoders.stage import ImageWork
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tests.vlmserve.engine.test_engine import chat, run_checked
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams

GREEDY_24 = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TEXT = " ".join(["what colour is the star on the left"] * 4)  # with 2 images: 74+ tokens


def engine_for(
    path, *, budget=512, num_blocks=1024, pan_and_scan=False, scheduler=None, speculative=None,
    encoder=None, **model,
):  # fmt: skip
    return Engine(
        EngineConfig(
            ModelConfig(str(path), **model),
            CacheConfig(num_blocks=num_blocks, block_size=4),
            SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, **(scheduler or {})),
            speculative=speculative or SpeculativeConfig(),
            encoder=EncoderConfig(pan_and_scan=pan_and_scan, **(encoder or {})),
        )
    )


def hf_greedy(path, images, text, pan_and_scan=False, max_new_tokens=24):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, attn_implementation="eager")
    processor = AutoProcessor.from_pretrained(path)
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(
        text=[prompt], images=images, return_tensors="pt", add_special_tokens=False,
        do_pan_and_scan=pan_and_scan,
    )  # fmt: skip
    with torch.no_grad():
        out = model.eval().generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(
    ("sizes", "pan_and_scan", "budget", "backend", "num_tiles"),
    [
        ([(100, 40), (50, 60)], False, 512, None, [1, 1]),  # whole prompt in one step
        # wide (1 + 3 crops), tall (1 + 2), too small for crops; one step
        ([(800, 300), (300, 700), (50, 60)], True, 512, None, [4, 3, 1]),
        # chunks of <= 24 cross the window edge
        pytest.param([(100, 40), (50, 60)], False, 24, None, [1, 1], marks=pytest.mark.slow),
        pytest.param([(100, 40), (50, 60)], False, 24, "torch", [1, 1], marks=pytest.mark.slow),
        # 1 + 3 crops: 4 spans of 16, chunks of <= 20
        pytest.param([(800, 300)], True, 20, None, [4], marks=pytest.mark.slow),
    ],
    ids=["one-step", "pan-and-scan-several", "chunked", "chunked-torch", "pan-and-scan"],
)
def test_greedy_matches_transformers(gemma3_path, random_image, sizes, pan_and_scan, budget,
                                     backend, num_tiles):  # fmt: skip
    images = [random_image(i, w, h) for i, (w, h) in enumerate(sizes)]
    ref_ids, ref_tokens = hf_greedy(gemma3_path, images, TEXT, pan_and_scan)
    assert len(ref_ids) > 64, "the prompt must cross the sliding window"
    engine = engine_for(
        gemma3_path, budget=budget, pan_and_scan=pan_and_scan, attention_backend=backend
    )
    prepared = engine.processor.process(chat(images, TEXT))
    assert prepared.token_ids == ref_ids
    # The pool's path: each image's tiles and tokens known from its header at arrival.
    assert all(isinstance(work, ImageWork) for work in prepared.works)
    assert [image.num_tiles for image in prepared.images] == num_tiles
    assert [image.num_tokens for image in prepared.images] == [16 * n for n in num_tiles]
    [out] = run_checked(engine, [chat(images, TEXT, GREEDY_24)])
    assert out.token_ids == ref_tokens
    image_id = engine.runner.model.image_token_id
    assert out.num_image_tokens == ref_ids.count(image_id) == 16 * sum(num_tiles)


def test_repeated_image_hits_the_encoder_cache(gemma3_path, random_image, tmp_path):
    """The same image file in a second request (different text before it, so the prefix
    cache cannot cover it) is an encoder-cache hit keyed by its content: the pool decodes it
    and the tower runs it once. The tokens equal the HF image processor's path
    (`use_pool=False`)."""
    path = tmp_path / "wide.png"
    random_image(11, 800, 300).save(path)

    def requests():
        return [chat([str(path)], TEXT, GREEDY_24, before=q) for q in ("red", "two blue")]

    engine = engine_for(gemma3_path, pan_and_scan=True)
    before = engine.stats()["preprocess_images"]
    first, second = run_checked(engine, requests()[:1]), run_checked(engine, requests()[1:])
    stats = engine.stats()
    assert (stats["encoder_cache_misses"], stats["encoder_cache_hits"]) == (1, 1)
    assert stats["preprocess_images"] == before + 1
    assert engine.runner.encoder_stage.num_tower_images == 1
    assert second[0].num_cached_tokens < 4, "the prefix cache covered the image"
    hf_path = engine_for(gemma3_path, pan_and_scan=True, encoder={"use_pool": False})
    assert hf_path.processor.image_spec is None
    expected = [o.token_ids for o in first + second]
    assert [o.token_ids for o in run_checked(hf_path, requests())] == expected


@pytest.mark.slow
def test_prefix_hit_preemption_and_async_keep_the_tokens(gemma3_path, random_image):
    """Second questions about the same image hit the prefix cache (never a partial image);
    a tiny pool preempts; async scheduling: all give the tokens of a fresh engine."""
    image = random_image(3, 70, 50)
    questions = [f"{TEXT} {w}" for w in ("red", "blue", "green", "one", "two", "three")]
    requests = [chat([image], q, GREEDY_24, request_id=f"q{i}") for i, q in enumerate(questions)]
    alone = [run_checked(engine_for(gemma3_path), [r])[0].token_ids for r in requests]
    requests = [chat([image], q, GREEDY_24, request_id=f"q{i}") for i, q in enumerate(questions)]
    shared = engine_for(gemma3_path, budget=32)
    first = run_checked(shared, requests[:1])
    rest = run_checked(shared, requests[1:])
    assert [o.token_ids for o in first + rest] == alone
    assert all(o.num_cached_tokens >= 16 for o in rest), "the image was not reused"
    requests = [chat([image], q, GREEDY_24, request_id=f"q{i}") for i, q in enumerate(questions)]
    # 180 blocks of one KV cache group (2 of the 12 layers): the bytes of 30 blocks of all
    # 12 layers, a pool two of these sequences cannot share.
    squeezed = engine_for(gemma3_path, budget=32, num_blocks=180, scheduler={"admission": "fcfs"})
    assert [o.token_ids for o in run_checked(squeezed, requests)] == alone
    assert squeezed.scheduler.num_preemptions > 0
    requests = [chat([image], q, GREEDY_24, request_id=f"q{i}") for i, q in enumerate(questions)]
    engine = engine_for(gemma3_path, budget=24, scheduler={"async_scheduling": True})
    assert [o.token_ids for o in run_checked(engine, requests)] == alone


@pytest.mark.slow
def test_text_only_gemma3_with_softcap_matches_transformers(gemma3_text_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(gemma3_text_path, attn_implementation="eager")
    assert hf.config.final_logit_softcapping == 3.0
    tokenizer = AutoTokenizer.from_pretrained(gemma3_text_path)
    prompt = "describe the picture of a red star on the left " * 9  # 90 tokens > window 64
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf.eval().generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # n-gram drafts on the repetitive prompt: verification rows over the sliding window.
    drafts = SpeculativeConfig(num_speculative_tokens=3, min_n=1, adaptive=False)
    for backend, speculative in ((None, None), ("torch", None), (None, drafts)):
        engine = engine_for(
            gemma3_text_path, budget=16, attention_backend=backend, speculative=speculative
        )
        [out] = run_checked(engine, [Request(prompt=prompt, sampling=params)])
        assert out.token_ids == ref.tolist()
        if speculative is not None:
            assert engine.stats()["spec_proposed"] > 0, "no drafts were verified"


@pytest.mark.slow
def test_generate_door_takes_pan_and_scan(gemma3_path, random_image, tmp_path, capsys):
    """`vlmserve generate --pan-and-scan` on a wide image: 1 + 3 crops of 16 tokens."""
    from vlmserve.cli.main import main

    path = tmp_path / "wide.png"
    random_image(9, 800, 300).save(path)
    args = ["generate", "--model", str(gemma3_path), "--image", str(path), "--prompt",
            "what colour is the star", "--max-tokens", "4"]  # fmt: skip
    assert main(args) == 0
    assert "(16 image)" in capsys.readouterr().err
    assert main([*args, "--pan-and-scan"]) == 0
    assert "(64 image)" in capsys.readouterr().err

"""Gemma 3 through the engine against transformers (eager attention, float32): prompts longer
than the sliding window (64), several images and pan-and-scan crops (bidirectional spans),
chunked prefill across the window edge, prefix-cache hits, preemption, async scheduling,
on the default CPU backend (the C++ kernels) and the torch reference."""

from __future__ import annotations

import pytest
import torch

from encoders.config import EncoderConfig
from scheduler.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tests.vlmserve.engine.test_engine import chat, run_checked
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams

GREEDY_24 = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TEXT = " ".join(["what colour is the star on the left"] * 4)  # with 2 images: 74+ tokens


def engine_for(
    path, *, budget=512, num_blocks=256, pan_and_scan=False, scheduler=None, speculative=None,
    **model,
):  # fmt: skip
    return Engine(
        EngineConfig(
            ModelConfig(str(path), **model),
            CacheConfig(num_blocks=num_blocks, block_size=4),
            SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, **(scheduler or {})),
            speculative=speculative or SpeculativeConfig(),
            encoder=EncoderConfig(pan_and_scan=pan_and_scan),
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
    ("sizes", "pan_and_scan", "budget", "backend"),
    [
        ([(100, 40), (50, 60)], False, 512, None),  # whole prompt in one step
        # chunks of <= 24 cross the window edge
        pytest.param([(100, 40), (50, 60)], False, 24, None, marks=pytest.mark.slow),
        pytest.param([(100, 40), (50, 60)], False, 24, "torch", marks=pytest.mark.slow),
        # 1 + 3 crops: 4 spans of 16, chunks of <= 20
        pytest.param([(800, 300)], True, 20, None, marks=pytest.mark.slow),
    ],
    ids=["one-step", "chunked", "chunked-torch", "pan-and-scan"],
)
def test_greedy_matches_transformers(gemma3_path, random_image, sizes, pan_and_scan, budget,
                                     backend):  # fmt: skip
    images = [random_image(i, w, h) for i, (w, h) in enumerate(sizes)]
    ref_ids, ref_tokens = hf_greedy(gemma3_path, images, TEXT, pan_and_scan)
    assert len(ref_ids) > 64, "the prompt must cross the sliding window"
    engine = engine_for(
        gemma3_path, budget=budget, pan_and_scan=pan_and_scan, attention_backend=backend
    )
    assert engine.processor.process(chat(images, TEXT)).token_ids == ref_ids
    [out] = run_checked(engine, [chat(images, TEXT, GREEDY_24)])
    assert out.token_ids == ref_tokens
    image_id = engine.runner.model.image_token_id
    assert out.num_image_tokens == ref_ids.count(image_id) == 16 * (len(sizes) + 3 * pan_and_scan)


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

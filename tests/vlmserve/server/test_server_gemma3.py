"""Gemma 3 through `serve`'s app on a loopback port with the openai client: the answer and
usage of a prompt past the sliding window with two images equal the offline engine's
(which tests/vlmserve/engine/test_gemma3.py holds to transformers); `/metrics` shows the
hybrid KV manager's sliding groups staying within the window on a long generation."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest
from server_testing import engine_config, greedy, png, serve, user, wait_until
from test_server import offline_answer

from scheduler.config import DEFAULT_DRAFTS, group_peak_blocks
from vlmserve.engine.core import Engine


@pytest.mark.slow
def test_gemma3_answer_matches_the_offline_engine(gemma3_path, random_image):
    text = " ".join(["what colour is the star on the left"] * 4)
    messages = [user(text, png(random_image, 1, 100, 40), png(random_image, 2, 50, 60))]
    ref = offline_answer(Engine(engine_config(gemma3_path)), messages, 12, ignore_eos=True)
    assert ref.num_prompt_tokens > 64 and ref.num_image_tokens == 32
    with serve(lambda: Engine(engine_config(gemma3_path))) as served:
        reply = served.client().chat.completions.create(messages=messages, **greedy(12))
    assert reply.choices[0].message.content == ref.text
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (ref.num_prompt_tokens, 12)
    assert usage.prompt_tokens_details.image_tokens == 32


def blocks_in_use(metrics_text: str, name: str = "vlmserve_kv_blocks_in_use") -> dict[str, float]:
    """`name{group="..."}` samples by group."""
    found = re.findall(rf'^{name}\{{group="(\w+)"\}} (\S+)$', metrics_text, re.M)
    return {group: float(value) for group, value in found}


@pytest.mark.slow
def test_metrics_show_sliding_kv_within_the_window_on_a_long_generation(gemma3_path):
    """/metrics while and after one long answer is generated (about 30 prompt + 200 output
    tokens, window 64, blocks of 4): the global layers' group keeps every block, so its
    count grows with the sequence; the five sliding groups stay within the window bound,
    each at most ceil((64 - 1 + 1) / 4) + 1 = 17 blocks while decoding, where all-global
    layers would hold five times the full group's (18 with the default speculation's 4
    drafts a step: ceil((64 - 1 + 5) / 4) + 1). The peaks are the engine's own (every
    step); the samples taken while it runs (as many as the machine's speed gives) agree."""
    samples = []
    with serve(lambda: Engine(engine_config(gemma3_path))) as served:
        metrics = lambda: httpx.get(served.url("/metrics")).text  # noqa: E731
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                served.client().chat.completions.create,
                messages=[user("count the stars on the left " * 4)], **greedy(200),
            )  # fmt: skip
            while not answer.done():
                if (sample := blocks_in_use(metrics())).get("full"):
                    samples.append(sample)
                time.sleep(0.05)
        assert answer.result().usage.completion_tokens == 200
        # All returned once the answer ends (cached blocks are free, not in use).
        done = lambda: blocks_in_use(metrics()) == {"full": 0.0, "sliding": 0.0}  # noqa: E731
        assert wait_until(done), metrics()
        peak = blocks_in_use(metrics(), "vlmserve_kv_blocks_in_use_peak")
    bound = 5 * group_peak_blocks(64, 4, 10**6, 1 + DEFAULT_DRAFTS)
    assert all(s["sliding"] <= bound for s in samples), samples
    assert peak["full"] >= 220 / 4  # the global layers held the whole sequence
    assert 0 < peak["sliding"] <= bound, peak
    assert peak["sliding"] < 5 * peak["full"] / 3, peak  # under a third of all-global's

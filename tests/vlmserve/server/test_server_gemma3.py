"""Gemma 3 through `serve`'s app on a loopback port with the openai client: the answer and
usage of a prompt past the sliding window with two images equal the offline engine's
(which tests/vlmserve/engine/test_gemma3.py holds to transformers)."""

from __future__ import annotations

import pytest
from server_testing import engine_config, greedy, png, serve, user
from test_server import offline_answer

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

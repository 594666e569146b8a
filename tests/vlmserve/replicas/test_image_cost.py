"""The router's view of the replicas' engine (`vlmserve.replicas.image_cost`): an image's
visual tokens from its header, the encoder cache in those tokens, checked against the HF
processor's count and the engine's own cache."""

from __future__ import annotations

import io

import pytest
from transformers import AutoProcessor

from scheduler.routing.policy import encoder_cache_tokens
from tests import helpers
from vlmserve.replicas.image_cost import RoutingProfile, engine_profile


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_cache_in_tokens_is_its_bytes_over_a_tokens_hidden_x_dtype_bytes():
    # A 7B decoder's 3584-wide bfloat16 embeddings in the engine's 256 MB default.
    assert encoder_cache_tokens(256 << 20, 3584, 2) == 37449  # 268435456 // 7168
    assert encoder_cache_tokens(7168 * 3 - 1, 3584, 2) == 2
    assert encoder_cache_tokens(0, 3584, 2) is None  # no cache: no model of one
    assert encoder_cache_tokens(7167, 3584, 2) is None  # not one token fits
    with pytest.raises(ValueError, match="hidden_size"):
        encoder_cache_tokens(1 << 20, 0, 2)


@pytest.mark.slow
def test_the_profile_prices_an_image_as_the_engine_and_hf_count_it_and_sizes_its_cache(
    llava_ov_path, random_image
):
    engine = helpers.make_engine(llava_ov_path, budget=512, encoder={"num_workers": 0})
    profile = engine_profile(engine)
    processor = AutoProcessor.from_pretrained(llava_ov_path)
    image_token_id = engine.runner.model.image_token_id
    cache = engine.runner.encoder_cache
    for size in ((90, 50), (40, 300)):
        image = random_image(3, *size)
        data = png(image)
        # transformers' count: the image tokens its processor puts in the prompt
        ids = processor(text=processor.image_token, images=[image], return_tensors="pt")
        hf_tokens = int((ids["input_ids"][0] == image_token_id).sum())
        before = cache.num_bytes
        [out] = engine.generate([helpers.chat([data], "what is it", helpers.greedy(2))])
        assert profile.image_tokens(data) == hf_tokens == out.num_image_tokens
        # What one visual token takes in the engine's encoder cache, measured there.
        per_token = (cache.num_bytes - before) // hf_tokens
        assert (cache.num_bytes - before) % hf_tokens == 0
        assert profile.encoder_cache_tokens == cache.max_bytes // per_token
    assert profile.image_tokens(b"\x89PNG\r\n\x1a\n truncated") is None  # a bad upload
    assert profile.image_tokens(b"") is None
    assert RoutingProfile(None, None).image_tokens(data) is None
    # The HF image processor's path: no prices from a header, so no model of the caches.
    hf_path = helpers.make_engine(llava_ov_path, encoder={"num_workers": 0, "use_pool": False})
    assert engine_profile(hf_path) == RoutingProfile(None, None)

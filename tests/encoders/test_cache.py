"""Encoder-output cache: exact LRU eviction under a byte budget, and through the engine a
hit gives the same tokens as a miss and one step encodes a repeated image once."""

from __future__ import annotations

import io

import pytest
import torch

from encoders.cache import EncoderCache, encoder_cache_key
from tests import helpers
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request


def value(num_floats: int) -> torch.Tensor:
    return torch.zeros(num_floats, dtype=torch.float32)  # 4 bytes each


def test_eviction_order_is_exact_lru_under_a_tiny_budget() -> None:
    cache = EncoderCache(max_bytes=40)
    cache.put(b"a", value(4))  # 16 bytes
    cache.put(b"b", value(3))  # 12
    cache.put(b"c", value(2))  # 8 -> 36 bytes
    assert cache.keys() == [b"a", b"b", b"c"]
    assert cache.get(b"a") is not None  # a becomes most recent
    cache.put(b"d", value(2))  # needs 8: evicts b (LRU), not a
    assert cache.keys() == [b"c", b"a", b"d"]
    cache.put(b"e", value(5))  # needs 20 of 40 with 32 held: evicts c then a
    assert cache.keys() == [b"d", b"e"]
    assert (cache.evictions, cache.num_bytes) == (3, 28)
    cache.put(b"huge", value(11))  # 44 > budget: not stored, nothing evicted
    assert cache.keys() == [b"d", b"e"] and b"huge" not in cache
    cache.put(b"d", value(1))  # replacing a key re-counts its bytes
    assert cache.keys() == [b"e", b"d"] and cache.num_bytes == 24
    assert cache.get(b"zzz") is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.num_entries) == (1, 1, 2)
    cache.check_integrity()


def test_zero_budget_disables_and_keys_depend_on_settings() -> None:
    cache = EncoderCache(0)
    cache.put(b"a", value(1))
    assert len(cache) == 0
    digest = b"\x01" * 16
    assert encoder_cache_key(digest, b"s1") != encoder_cache_key(digest, b"s2")
    assert encoder_cache_key(digest, b"s1") != encoder_cache_key(digest, b"s1", multi_image=True)
    with pytest.raises(ValueError):
        EncoderCache(-1)


def make_engine(path, **encoder) -> Engine:
    encoder = {"num_workers": 0, **encoder}
    return helpers.make_engine(path, budget=512, max_num_seqs=8, encoder=encoder)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def ask(image, before: str, after: str = "what colour is the star", **kw) -> Request:
    # text BEFORE the image: a different prefix, so the prefix cache cannot stand in for
    # the encoder cache
    return helpers.chat([image], after, helpers.greedy(6), before=before, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava_onevision", "idefics3"])
def test_a_cache_hit_gives_the_same_tokens_as_a_miss(family, request, random_image) -> None:
    path = request.getfixturevalue("llava_ov_path" if family == "llava_onevision"
                                   else "idefics3_path")  # fmt: skip
    data = png_bytes(random_image(3, 90, 50))
    engine = make_engine(path)
    stage = engine.runner.encoder_stage
    [first] = engine.generate([ask(data, "tell me")])
    assert (engine.runner.encoder_cache.misses, stage.num_tower_images) == (1, 1)
    [second] = engine.generate([ask(data, "please")])
    assert engine.runner.encoder_cache.hits == 1
    assert stage.num_tower_images == 1, "the hit must not run the tower"
    [fresh] = make_engine(path, cache_bytes=0).generate([ask(data, "please")])
    assert second.token_ids == fresh.token_ids and len(fresh.token_ids) == 6
    assert first.error is None and second.error is None


def test_the_tower_runs_once_for_two_requests_with_the_same_image_in_one_step(
    llava_ov_path, random_image
) -> None:
    image = random_image(5, 70, 40)
    engine = make_engine(llava_ov_path)
    engine.add_request(ask(image, "tell me", request_id="a"))
    engine.add_request(ask(image, "please", request_id="b"))
    engine.step()  # both prefills fit the 512-token budget: one step
    stage = engine.runner.encoder_stage
    assert (stage.num_tower_calls, stage.num_tower_images) == (1, 1)
    while engine.has_unfinished():
        engine.step()
    assert stage.num_tower_images == 1


@pytest.mark.slow
def test_pool_workers_serve_the_same_tokens_as_inline(idefics3_path, random_image) -> None:
    data = png_bytes(random_image(8, 70, 45))
    pooled = helpers.make_engine(idefics3_path, encoder={"num_workers": 2, "cache_bytes": 0})
    [out] = pooled.generate([ask(data, "tell me")])
    [inline] = make_engine(idefics3_path).generate([ask(data, "tell me")])
    assert out.error is None and out.token_ids == inline.token_ids
    [bad] = pooled.generate([ask(data[: len(data) // 3], "tell me")])
    assert bad.finish_reason == "error" and "cannot decode image" in bad.error

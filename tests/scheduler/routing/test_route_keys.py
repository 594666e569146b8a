"""Routing keys from an OpenAI body and from a scheduler Sequence."""

from __future__ import annotations

import base64
import hashlib

from scheduler.prefix_hash import block_hash
from scheduler.routing.route_keys import (
    BYTES_PER_BLOCK,
    IMAGE_WEIGHT_TOKENS,
    keys_from_body,
    keys_from_sequence,
)
from scheduler.sequence import ImagePlaceholder, Sequence

SYSTEM = "You are a careful assistant that describes images. " * 4  # > 2 blocks of bytes


def data_url(payload: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(payload).decode()


def chat(image: bytes | None, question: str, **extra) -> dict:
    content = [{"type": "text", "text": question}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(image)}})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    return {"model": "m", "messages": messages, **extra}


def test_the_image_key_is_the_blake2b_16_of_the_raw_bytes():
    keys = keys_from_body(chat(b"\x89PNG fake bytes", "What is it?"))
    reference = hashlib.blake2b(b"\x89PNG fake bytes", digest_size=16).digest()
    assert keys.image_keys[0][0] == reference


def test_the_same_system_prompt_shares_its_blocks_and_the_image_splits_ours_not_text():
    question = "What colour is the square in the top left corner, and what is written on it?"
    a = keys_from_body(chat(b"image one", question))
    b = keys_from_body(chat(b"image two", question))
    # The byte stream: "\0system\0" + SYSTEM, then "\0user\0", the image, the question.
    shared = (len("\0system\0") + len(SYSTEM) + len("\0user\0")) // BYTES_PER_BLOCK
    assert shared >= 3
    assert a.block_hashes[:shared] == b.block_hashes[:shared]
    assert a.block_hashes[shared:] != b.block_hashes[shared:]  # the image differs
    assert a.text_block_hashes == b.text_block_hashes  # text routers cannot tell them apart
    assert a.image_keys != b.image_keys


def test_the_first_block_is_the_prefix_hash_of_its_first_64_bytes():
    keys = keys_from_body({"prompt": "x" * 130})
    first = block_hash(None, list(b"x" * BYTES_PER_BLOCK))
    assert keys.block_hashes[0] == first
    assert len(keys.block_hashes) == 2  # two full blocks; the last 2 bytes are no block


def test_the_session_header_wins_over_the_user_field():
    assert keys_from_body(chat(None, "hi", user="alice")).session == "alice"
    headers = {"X-Session-Id": "conv-7"}
    assert keys_from_body(chat(None, "hi", user="alice"), headers).session == "conv-7"
    assert keys_from_body(chat(None, "hi")).session is None


def test_malformed_parts_are_skipped_not_raised():
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": 3},
                    "junk",
                    {"type": "text", "text": 5},
                ],
            }
        ]
    }
    keys = keys_from_body(body)
    assert keys.image_keys == ()
    assert keys_from_body({"messages": "nope"}).block_hashes == ()


def test_sequence_keys_follow_the_prefix_cache_and_leave_images_out_of_the_text_chain():
    def seq(image: bytes) -> Sequence:
        ids = list(range(1, 17)) + [0] * 16 + list(range(100, 116))
        s = Sequence("r", ids, [ImagePlaceholder(image, list(range(16, 32)))])
        s.num_prompt_tokens = len(ids)
        return s

    a, b = keys_from_sequence(seq(b"A"), 16), keys_from_sequence(seq(b"B"), 16)
    keys = [a.block_hashes[0]]
    assert a.block_hashes[0] == block_hash(None, list(range(1, 17)))
    image_block = block_hash(keys[0], [(b"A", i) for i in range(16)])
    assert a.block_hashes[1] == image_block
    assert a.block_hashes[0] == b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]
    assert a.text_block_hashes == b.text_block_hashes and len(a.text_block_hashes) == 2
    assert a.image_keys == ((b"A", 16),)


def test_an_uploads_weight_is_its_priced_tokens_and_unknown_ones_get_the_stand_in():
    seen = []

    def price(data: bytes) -> int | None:
        seen.append(data)
        return {b"small image": 300, b"bad image": None}[data]

    body = chat(b"small image", "What is it?")
    assert keys_from_body(body, image_tokens=price).image_keys[0][1] == 300
    assert seen == [b"small image"]  # the upload's raw bytes, not its key or URL
    assert keys_from_body(chat(b"bad image", "?"), image_tokens=price).image_keys[0][1] == (
        IMAGE_WEIGHT_TOKENS
    )
    remote = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}  # fmt: skip
    assert keys_from_body(remote, image_tokens=price).image_keys[0][1] == IMAGE_WEIGHT_TOKENS
    assert len(seen) == 2  # a remote URL has no bytes here: never priced
    assert keys_from_body(body).image_keys[0][1] == IMAGE_WEIGHT_TOKENS  # no pricing given

"""A request's routing keys (`RouteKeys`), from an OpenAI JSON body or from a Sequence.

From a Sequence (the simulator): the prefix cache's own block hashes
(`scheduler.prefix_hash`), images by content; the text-only chain leaves image positions
out, as a text-prefix router would.

From an HTTP body (the front door, before any replica has tokenised it): the same
chained `block_hash`, over a key stream that stands in for tokens without a tokenizer:
each message's role, then its text as UTF-8 bytes (one key per byte, `BYTES_PER_BLOCK`
bytes a block, about 16 tokens of English), an image as one key (its content hash, as
`encoders.images.content_hash` computes it over the raw bytes of a `data:` URL; a URL's
own text for a remote one). Two prompts share a block exactly when everything up to
its end is byte-identical, which is when their token blocks agree too.

An image's weight is its visual tokens where the caller can price an upload from its
bytes (`image_tokens`: the front door reads the header as the engine does), else
`IMAGE_WEIGHT_TOKENS` (a remote URL, an image whose header does not parse, no pricing).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from scheduler.prefix_hash import block_hash, extend_block_hashes
from scheduler.routing.policy import RouteKeys
from scheduler.sequence import Sequence

__all__ = ["BYTES_PER_BLOCK", "IMAGE_WEIGHT_TOKENS", "keys_from_body", "keys_from_sequence"]

BYTES_PER_BLOCK = 64
# An image's weight when its visual tokens are unknown (a remote URL, a bad header).
IMAGE_WEIGHT_TOKENS = 1024
_TEXT_ROOT = b"text-only"  # the text chain's parent: never equal to an image-aware hash


def content_hash(data: bytes) -> bytes:
    """The encoder cache's content key: `encoders.images.content_hash` (a test holds the
    two equal; encoders/ is not imported here, it loads the image stack)."""
    return hashlib.blake2b(data, digest_size=16).digest()


def keys_from_sequence(
    seq: Sequence, block_size: int, session: str | None = None, num_tokens: int | None = None
) -> RouteKeys:
    """Keys of `seq`'s first `num_tokens` tokens (default: its prompt)."""
    n = seq.num_prompt_tokens if num_tokens is None else num_tokens
    hashes = tuple(extend_block_hashes(seq, n, block_size))
    image_at = {p for img in seq.images for p in img.positions}
    text = [t for p, t in enumerate(seq.token_ids[:n]) if p not in image_at]
    images = tuple((img.content_hash, img.num_tokens) for img in seq.images)
    return RouteKeys(images, hashes, _chain(text, block_size, _TEXT_ROOT), block_size, session)


def keys_from_body(
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    image_tokens: Callable[[bytes], int | None] | None = None,
) -> RouteKeys:
    """Keys of a `/v1/chat/completions` or `/v1/completions` body; malformed parts are
    skipped (the replica answers them with its own 400). `image_tokens(data)`: an
    uploaded image's visual tokens, None where unknown."""
    stream: list[int | tuple[bytes, int]] = []
    images: list[tuple[bytes, int]] = []
    for part in _parts(body):
        if isinstance(part, _ImageKey):
            key = bytes(part)
            stream.append((key, 0))
            priced = image_tokens is not None and part.data is not None
            tokens = image_tokens(part.data) if priced else None  # type: ignore[misc]
            images.append((key, tokens or IMAGE_WEIGHT_TOKENS))  # 0 or None: unknown
        else:
            stream.extend(part)
    text = [k for k in stream if not isinstance(k, tuple)]
    session = _session(body, headers or {})
    return RouteKeys(
        tuple(images),
        _chain(stream, BYTES_PER_BLOCK, None),
        _chain(text, BYTES_PER_BLOCK, _TEXT_ROOT),
        BYTES_PER_BLOCK,
        session,
    )


def _session(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    for name, value in headers.items():
        if name.lower() == "x-session-id" and value:
            return str(value)
    user = body.get("user")
    return user if isinstance(user, str) and user else None


def _chain(keys: list, block_size: int, root: bytes | None) -> tuple[bytes, ...]:
    hashes: list[bytes] = []
    for b in range(len(keys) // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(block_hash(parent, keys[b * block_size : (b + 1) * block_size]))
    return tuple(hashes)


def _parts(body: Mapping[str, Any]) -> Iterator[bytes]:
    """The prompt in order: text as bytes, each image as its `_ImageKey`."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        yield prompt.encode()
        return
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        yield f"\x00{message.get('role', '')}\x00".encode()
        content = message.get("content")
        if isinstance(content, str):
            yield content.encode()
            continue
        for item in content if isinstance(content, list) else ():
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text" and isinstance(item.get("text"), str):
                yield item["text"].encode()
            elif item.get("type") in ("image_url", "image"):
                key = _image_key(item)
                if key is not None:
                    yield key


class _ImageKey(bytes):
    """An image's content key among the text bytes `_parts` yields; `data`: its bytes
    (an upload's), None for a remote URL."""

    data: bytes | None = None


def _image_key(item: Mapping[str, Any]) -> _ImageKey | None:
    ref = item.get("image_url") if item.get("type") == "image_url" else item.get("image")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str) or not url:
        return None
    if url.startswith("data:") and "," in url:
        meta, payload = url[5:].split(",", 1)
        if meta.endswith(";base64"):
            try:
                data = base64.b64decode(payload, validate=False)
            except (binascii.Error, ValueError):
                return None
            key = _ImageKey(content_hash(data))
            key.data = data
            return key
    return _ImageKey(content_hash(url.encode()))  # a remote or file URL: its text stands in

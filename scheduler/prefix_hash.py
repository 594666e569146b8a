"""Chained block hashes for the prefix cache.

hash(block i) = H(hash(block i-1), keys of the block's tokens), where a token's key is its
id, or (image content hash, offset) for an image placeholder. So two prompts share a
block exactly when everything before it and in it is the same, images included: the KV
of an image is reused by a later question about the same image.
"""

from __future__ import annotations

import hashlib
import struct

from scheduler.sequence import Sequence

_TEXT = b"t"
_IMAGE = b"i"


def block_hash(parent: bytes | None, keys: list[int | tuple[bytes, int]]) -> bytes:
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    for key in keys:
        if isinstance(key, tuple):
            h.update(_IMAGE + key[0] + struct.pack("<q", key[1]))
        else:
            h.update(_TEXT + struct.pack("<q", key))
    return h.digest()


def extend_block_hashes(seq: Sequence, num_tokens: int, block_size: int) -> list[bytes]:
    """Hashes of every full block within the first `num_tokens` tokens of `seq`, computing
    only the ones not hashed yet."""
    hashes = seq.block_hashes
    for b in range(len(hashes), num_tokens // block_size):
        keys = [seq.token_key(p) for p in range(b * block_size, (b + 1) * block_size)]
        hashes.append(block_hash(hashes[-1] if hashes else None, keys))
    return hashes[: num_tokens // block_size]

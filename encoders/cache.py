"""Encoder-output cache: pooled visual embeddings keyed by image content + settings.

A second question about the same image (article §17) then skips decode, tiling and the
vision tower. LRU under a byte budget; the values stay on the runner's device. The key
is `encoder_cache_key(content_hash, spec_key, multi_image)`: the raw-bytes hash plus a
digest of every processing setting that changes the embeddings.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["EncoderCache", "EncoderCacheStats", "encoder_cache_key"]


def encoder_cache_key(content_hash: bytes, settings: bytes, multi_image: bool = False) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(content_hash)
    digest.update(settings)
    digest.update(b"\x01" if multi_image else b"\x00")
    return digest.digest()


@dataclass(frozen=True)
class EncoderCacheStats:
    hits: int
    misses: int
    evictions: int
    num_entries: int
    num_bytes: int
    max_bytes: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class EncoderCache:
    """LRU of embedding tensors; `num_bytes` never exceeds `max_bytes` (0 disables it).

    A value larger than the whole budget is not stored (it would evict everything for
    one entry that cannot be reused before it is evicted itself)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder cache max_bytes={max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # oldest first
        self.num_bytes = 0
        self.hits = self.misses = self.evictions = 0

    @staticmethod
    def nbytes(value: torch.Tensor) -> int:
        return value.numel() * value.element_size()

    def __contains__(self, key: bytes) -> bool:
        """Peek: no counters, no LRU update."""
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        size = self.nbytes(value)
        if key in self._entries:
            self.num_bytes -= self.nbytes(self._entries.pop(key))
        if size > self.max_bytes:
            return
        while self.num_bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= self.nbytes(evicted)
            self.evictions += 1
        self._entries[key] = value
        self.num_bytes += size

    def keys(self) -> list[bytes]:
        """Least recently used first."""
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(self.hits, self.misses, self.evictions, len(self._entries),
                                 self.num_bytes, self.max_bytes)  # fmt: skip

    def check_integrity(self) -> None:
        total = sum(self.nbytes(v) for v in self._entries.values())
        assert total == self.num_bytes, f"cache counts {self.num_bytes} bytes, holds {total}"
        assert self.num_bytes <= self.max_bytes, f"{self.num_bytes} > budget {self.max_bytes}"

"""Encoder-output cache: pooled visual embeddings keyed by image content + settings.

A second question about the same image (article §17) then skips decode, tiling and the
vision tower. LRU under a byte budget; the values stay on the runner's device. The key
is `encoder_cache_key(content_hash, spec_key, multi_image)`: the raw-bytes hash plus a
digest of every processing setting that changes the embeddings.

Thread-safe: preparer threads `peek` (and pin what they find, see `encoders.stage`)
while the engine thread gets and puts.
"""

from __future__ import annotations

import hashlib
import threading
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
        self._lock = threading.Lock()

    @staticmethod
    def nbytes(value: torch.Tensor) -> int:
        return value.numel() * value.element_size()

    def __contains__(self, key: bytes) -> bool:
        """Peek: no counters, no LRU update."""
        return self.peek(key) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: bytes) -> torch.Tensor | None:
        """The value without counting a hit or refreshing it (a caller that pins it
        counts the hit when it takes it: `note_hit`)."""
        with self._lock:
            return self._entries.get(key)

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return value

    def note_hit(self, key: bytes) -> None:
        """A pinned value was taken: a hit, and most recently used if still held."""
        with self._lock:
            self.hits += 1
            if key in self._entries:
                self._entries.move_to_end(key)

    def touch(self, key: bytes) -> None:
        """A pinned value was used again (its hit already counted): most recently used."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def put(self, key: bytes, value: torch.Tensor) -> None:
        size = self.nbytes(value)
        with self._lock:
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
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0

    def stats(self) -> EncoderCacheStats:
        with self._lock:
            return EncoderCacheStats(self.hits, self.misses, self.evictions, len(self._entries),
                                     self.num_bytes, self.max_bytes)  # fmt: skip

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(self.nbytes(v) for v in self._entries.values())
            assert total == self.num_bytes, f"cache counts {self.num_bytes} bytes, holds {total}"
            assert self.num_bytes <= self.max_bytes, f"{self.num_bytes} > budget {self.max_bytes}"

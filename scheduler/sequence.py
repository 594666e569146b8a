"""The scheduler's view of one request: its tokens, where its images sit, and how much
of it has KV in the cache. No torch here: the runner owns tensors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

SequenceStatus = Literal["waiting", "running", "finished"]

_arrival = itertools.count()


@dataclass
class ImagePlaceholder:
    """One image of a prompt: the positions of its placeholder tokens, in the order its
    embeddings fill them, and the hash of its raw content (for prefix caching)."""

    content_hash: bytes
    positions: list[int]
    # Tiles the tower runs for it (the per-step encoder budget); 0 = unknown, counts as 1.
    num_tiles: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    images: list[ImagePlaceholder] = field(default_factory=list)
    num_prompt_tokens: int = 0
    status: SequenceStatus = "waiting"
    # Invariant: tokens [0, num_computed_tokens) have their KV in the cache.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at admission
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    # Leading entries of block_table the runner holds (StepPlan sends the rest as a delta);
    # the block manager lowers it when it drops blocks.
    num_synced_blocks: int = 0
    # Hybrid KV (scheduler/kv_blocks.py): the block tables of KV cache groups 1.. (a
    # sliding group's entries before its window are the null block) and, per table, the
    # leading entries the runner holds. Empty for a model with one group.
    group_block_tables: list[list[int]] = field(default_factory=list)
    num_synced_group_blocks: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks so far (prefix cache); extended lazily.
    block_hashes: list[bytes] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival))
    # When the request arrived, on the scheduler's clock (slack against a TTFT target);
    # None: the scheduler stamps it when the sequence is added.
    arrival_time: float | None = None
    # When its first output token was sampled, on the scheduler's clock (its TPOT counts
    # from there); None: not yet, or no clock.
    first_token_time: float | None = None
    # False while its images are still being decoded: never admitted until it is True.
    ready: bool = True
    # Steps spent ready in the waiting queue since it was added or last admitted (aging).
    num_waiting_steps: int = 0
    # Tokens sampled by a step still in flight (async scheduling): they count in
    # num_tokens but are not in token_ids yet; they lie past its end until resolved.
    num_pending_tokens: int = 0
    # False: never start from prefix-cache hits (prompt logprobs need every position run).
    use_prefix_cache: bool = True
    # False: never given n-gram drafts (the engine's choice for a seeded sampled request
    # under adaptive speculation, whose drafts would make its tokens depend on the load).
    may_draft: bool = True
    # [start, end) position ranges that attend to each other in full (scheduler/spans.py):
    # a chunk never ends inside one. Empty: causal everywhere.
    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        self._image_keys: dict[int, tuple[bytes, int]] = {
            pos: (img.content_hash, offset)
            for img in self.images
            for offset, pos in enumerate(img.positions)
        }

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_key(self, position: int) -> int | tuple[bytes, int]:
        """What identifies the KV at `position`: the token id, or for an image placeholder
        (image content hash, offset in the image) since all placeholders share one id."""
        return self._image_keys.get(position, self.token_ids[position])

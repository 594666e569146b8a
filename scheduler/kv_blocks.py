"""Paged KV block allocator with copy-free prefix sharing.

Invariants (checked by `check_integrity`):
- a block's ref_count equals the number of live block tables that hold it;
- a block is in the free queue exactly when its ref_count is 0;
- `_cached` maps a hash to a block that carries that hash. Free blocks keep their hash
  (and stay findable) until they are handed out again: the free queue is the LRU order
  in which cached KV is evicted, uncached blocks first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from scheduler.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}  # request_id -> the seq's block_table

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Cached blocks holding the longest run of `hashes` from the start."""
        if not self.enable_prefix_caching:
            return []
        matched = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def cost_of(self, matched: list[int], num_tokens: int) -> int:
        """Free blocks that holding `num_tokens` would consume, given the matched prefix
        (a matched block in use costs nothing; a matched free one leaves the free queue)."""
        in_use = sum(1 for b in matched if self.blocks[b].ref_count > 0)
        return self.blocks_for(num_tokens) - in_use

    def register(self, hashes: list[bytes], block_table: list[int]) -> None:
        """Make the full blocks `block_table[i]` findable under `hashes[i]`."""
        if not self.enable_prefix_caching:
            return
        for h, block_id in zip(hashes, block_table, strict=False):  # only full blocks hash
            block = self.blocks[block_id]
            if block.hash is None and h not in self._cached:
                block.hash = h
                self._cached[h] = block_id

    # -- allocation ---------------------------------------------------------------------

    def take(self, seq: Sequence, matched: list[int]) -> None:
        """Start `seq`'s block table with the matched prefix blocks (shared, ref counted)."""
        assert seq.request_id not in self._tables, f"{seq.request_id} already holds blocks"
        for block_id in matched:
            self._ref(block_id)
        seq.block_table = list(matched)
        seq.num_synced_blocks = 0
        self._tables[seq.request_id] = seq.block_table

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table to hold `num_tokens` tokens."""
        table = self._tables.setdefault(seq.request_id, seq.block_table)
        assert table is seq.block_table, "block table replaced behind the manager's back"
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict the cached KV it held
                del self._cached[block.hash]
                block.hash = None
            block.ref_count = 1
            table.append(block_id)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the blocks beyond `num_tokens` (rolling back rejected draft slots)."""
        keep = self.blocks_for(num_tokens)
        seq.num_synced_blocks = min(seq.num_synced_blocks, keep)
        while len(seq.block_table) > keep:
            self._unref(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        table = self._tables.pop(seq.request_id, None)
        seq.num_synced_blocks = 0
        if table is None:
            return
        # Tail first: the end of a prompt is the least likely to be shared later.
        for block_id in reversed(table):
            self._unref(block_id)
        table.clear()

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.hash is None:  # nothing worth keeping: hand it out first
                self._free.move_to_end(block_id, last=False)

    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"{request_id} holds a block twice"
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {refs[block.block_id]} tables"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: ref_count {block.ref_count} but "
                f"{'in' if block.block_id in self._free else 'not in'} the free queue"
            )
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].hash == h, f"cache entry for block {block_id} is stale"
        assert sum(b.hash is not None for b in self.blocks) == len(self._cached)

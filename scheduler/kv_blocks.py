"""Paged KV block allocator with copy-free prefix sharing, over one or more KV cache groups
(the hybrid KV manager; vLLM's hybrid allocator is the model).

A model whose layers all attend alike has one group: one block table per sequence, each
block the KV of every layer for `block_size` tokens. A model that mixes full and
sliding-window layers (Gemma 3: five sliding to one global) has its layers split into
groups of one kind and equal size (`config.kv_cache_groups`): each group keeps its own block
table per sequence, and every group draws on ONE pool of physical blocks, a block being
the KV of `layers_per_block` layers whichever group holds it, so memory stays fungible
between the kinds. A sliding-window group returns to the pool every block that lies
wholly before the window of the sequence's next query (`release_skipped`) and puts the
null block in its place: a reserved block no table holds, no step writes and no kernel
reads unmasked. Full groups keep every block.

Prefix caching per group: a block is cached under its chain hash tagged with its group.
A full group reuses the longest run of cached blocks from the start; a sliding group only
a prefix whose last window is still cached (`find_prefix`, vLLM's
SlidingWindowManager.find_longest_cache_hit rule); the hit is the longest all groups allow.

Invariants (checked by `check_integrity`):
- a block's ref_count equals the number of live block-table entries that hold it;
- a block is in the free queue exactly when its ref_count is 0 (the null block: never);
- `_cached` maps a key to a block that carries that key. Free blocks keep their key (and
  stay findable) until they are handed out again: the free queue is the LRU order in
  which cached KV is evicted, uncached blocks first;
- a sliding group's null entries are exactly the leading run `_num_null` counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as SeqList
from dataclasses import dataclass

from scheduler.config import group_peak_blocks, seq_peak_blocks
from scheduler.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # the key it is cached under (the group's tag included)
    group: int = 0  # the group whose tables hold it (meaningful while held or cached)


@dataclass(frozen=True)
class PrefixHit:
    """Cached KV a new sequence starts from: its first `num_blocks` blocks, per group the
    block ids (the null block where a sliding group needs none)."""

    num_blocks: int
    tables: tuple[tuple[int, ...], ...]


class BlockManager:
    """The pool and every sequence's block tables, one per KV cache group. `windows`: each
    group's sliding window (None: full attention); `max_step_tokens`: the most tokens a
    step computes for one sequence (it bounds what a sliding group holds at once)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: SeqList[int | None] = (None,),
        max_step_tokens: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"KV cache group windows {list(windows)} must be >= 1 (or None)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.max_step_tokens = max_step_tokens
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]
        # Block 0 is the null block where a group slides: never free, never held.
        self.null_block: int | None = 0 if self._sliding else None
        if self.null_block is not None and num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: a sliding group needs >= 2 (one null)")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(num_blocks) if i != self.null_block
        )
        self._cached: dict[bytes, int] = {}
        # request_id -> the seq's block tables, one per group (the first is seq.block_table)
        self._tables: dict[str, list[list[int]]] = {}
        self._num_null: dict[str, list[int]] = {}  # request_id -> leading null entries per group
        self._in_use = [0] * len(self.windows)  # blocks held, per group
        self.peak_by_kind = {"full": 0, "sliding": 0}  # most held at once (`note_peak`)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold: the pool less the null block."""
        return self.num_blocks - (self.null_block is not None)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def footprint(self, num_tokens: int, max_step_tokens: int | None = None) -> int:
        """Blocks of the pool a sequence of `num_tokens` tokens holds at most at once, over
        every group (one group: `blocks_for`); `max_step_tokens`: the most it computes in
        one step from now on (default: the step budget)."""
        if len(self.windows) == 1 and self.null_block is None:
            return self.blocks_for(num_tokens)
        step = self.max_step_tokens if max_step_tokens is None else max_step_tokens
        return seq_peak_blocks(self.windows, self.block_size, num_tokens, step)

    def max_tokens_within(self, num_blocks: int) -> int:
        """The longest sequence whose `footprint` fits in `num_blocks` blocks."""
        lo, hi = 0, max(0, num_blocks) * self.block_size
        if self.footprint(hi) <= num_blocks:
            return hi
        while lo < hi:  # footprint is monotone in the tokens
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.footprint(mid) <= num_blocks else (lo, mid - 1)
        return lo

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks `seq`'s tables hold (null entries aside)."""
        if self.null_block is None and len(self.windows) == 1:
            return len(seq.block_table)
        nulls = self._num_null.get(seq.request_id)
        tables = self._seq_tables(seq)
        return sum(len(t) for t in tables) - (sum(nulls) if nulls else 0)

    def blocks_in_use(self, group: int) -> int:
        """Blocks the tables of `group` hold (a shared one once)."""
        return self._in_use[group]

    def in_use_by_kind(self) -> dict[str, int]:
        """Blocks the full-attention groups and the sliding-window ones hold."""
        full = sum(n for n, w in zip(self._in_use, self.windows, strict=True) if w is None)
        return {"full": full, "sliding": sum(self._in_use) - full}

    def note_peak(self) -> None:
        """Raise `peak_by_kind` to what is held now (the planner calls it after growing)."""
        for kind, held in self.in_use_by_kind().items():
            self.peak_by_kind[kind] = max(self.peak_by_kind[kind], held)

    # -- prefix cache -------------------------------------------------------------------

    def _key(self, group: int, h: bytes) -> bytes:
        return h if group == 0 else h + bytes((group,))

    def match_prefix(self, hashes: list[bytes], limit: int | None = None) -> list[int]:
        """Cached blocks of group 0 holding the longest run of `hashes` from the start (at
        most `limit` of them)."""
        if not self.enable_prefix_caching:
            return []
        matched, cached = [], self._cached
        for i in range(len(hashes) if limit is None else min(limit, len(hashes))):
            block_id = cached.get(hashes[i])
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def find_prefix(
        self, hashes: list[bytes], max_blocks: int, safe_end: Callable[[int], int] | None = None
    ) -> PrefixHit:
        """The longest cached prefix of `hashes`, at most `max_blocks` blocks, that every
        group can start from: full groups need all its blocks cached, sliding groups the
        blocks of the window before its end. `safe_end(num_tokens)`: the longest reusable
        prefix within `num_tokens` (image spans); the hit is cut to it and searched again
        (a shorter hit needs another window)."""
        limit = min(len(hashes), max_blocks) if self.enable_prefix_caching else 0
        if self.null_block is None and self.num_groups == 1:  # one full group: one pass
            matched = self.match_prefix(hashes, limit)
            if safe_end is not None:  # a full prefix cut shorter stays a hit
                matched = matched[: safe_end(len(matched) * self.block_size) // self.block_size]
            return PrefixHit(len(matched), (tuple(matched),))
        while True:
            k = limit
            for g, window in enumerate(self.windows):
                if window is None:
                    k = self._full_hit(g, hashes, k)
            if self._sliding:
                k = self._sliding_hit(hashes, k)
            if (
                safe_end is not None
                and (safe := safe_end(k * self.block_size)) < k * self.block_size
            ):
                limit = safe // self.block_size
                continue
            return PrefixHit(
                k, tuple(self._hit_table(g, hashes, k) for g in range(self.num_groups))
            )

    def _full_hit(self, group: int, hashes: list[bytes], limit: int) -> int:
        for i in range(limit):
            if self._key(group, hashes[i]) not in self._cached:
                return i
        return limit

    def _window_blocks(self, group: int) -> int:
        """Blocks before a block boundary that its next query's window reaches into."""
        window = self.windows[group]
        assert window is not None
        return -(-(window - 1) // self.block_size)

    def _sliding_hit(self, hashes: list[bytes], limit: int) -> int:
        """The longest hit within `limit` blocks whose last window blocks are cached in every
        sliding group (or all of whose blocks are, from the start)."""
        need = max(self._window_blocks(g) for g in self._sliding)
        if need == 0:
            return limit
        run = 0
        for i in range(limit - 1, -1, -1):
            if all(self._key(g, hashes[i]) in self._cached for g in self._sliding):
                run += 1
                if run >= need:
                    return i + run
            else:
                run = 0
        return run

    def _hit_table(self, group: int, hashes: list[bytes], num: int) -> tuple[int, ...]:
        first = 0 if self.windows[group] is None else max(0, num - self._window_blocks(group))
        assert first == 0 or self.null_block is not None
        held = [self._cached[self._key(group, hashes[i])] for i in range(first, num)]
        return (self.null_block,) * first + tuple(held) if first else tuple(held)

    def _as_hit(self, matched: list[int] | PrefixHit) -> PrefixHit:
        if isinstance(matched, PrefixHit):
            return matched
        assert self.num_groups == 1 or not matched, "a multi-group hit comes from find_prefix"
        return PrefixHit(len(matched), (tuple(matched),) + ((),) * (self.num_groups - 1))

    def cost_of(
        self, matched: list[int] | PrefixHit, num_tokens: int, max_step_tokens: int | None = None
    ) -> int:
        """Free blocks that holding `num_tokens` would consume at most, given the matched
        prefix (a matched block in use costs nothing; a matched free one leaves the free
        queue; a sliding group never holds more than its peak, for steps of at most
        `max_step_tokens`, default the step budget)."""
        hit, cost = self._as_hit(matched), 0
        step = self.max_step_tokens if max_step_tokens is None else max_step_tokens
        new = self.blocks_for(num_tokens) - hit.num_blocks
        for g, table in enumerate(hit.tables):
            present = [b for b in table if b != self.null_block]
            in_use = sum(1 for b in present if self.blocks[b].ref_count > 0)
            peak = group_peak_blocks(self.windows[g], self.block_size, num_tokens, step)
            cost += min(len(present) + new, max(peak, len(present))) - in_use
        return cost

    def register(self, hashes: list[bytes], block_table: list[int], group: int = 0) -> None:
        """Make the full blocks `block_table[i]` of `group` findable under `hashes[i]`. Run
        after every step: only blocks filled since are visited, from the last full one back
        to one registered or released (blocks fill in order, a window frees the oldest); a
        block that filled while another held its content stays unregistered."""
        if not self.enable_prefix_caching:
            return
        null, blocks, cached = self.null_block, self.blocks, self._cached  # no calls
        tag = bytes((group,)) if group else b""
        for i in range(min(len(hashes), len(block_table)) - 1, -1, -1):  # full blocks hash
            block_id = block_table[i]
            if block_id == null or blocks[block_id].hash is not None:
                break
            key = hashes[i] + tag if tag else hashes[i]
            if key not in cached:
                blocks[block_id].hash = key
                cached[key] = block_id

    def register_seq(self, hashes: list[bytes], seq: Sequence) -> None:
        """`register` every group's table of `seq`."""
        if self.num_groups == 1:
            self.register(hashes, seq.block_table)
            return
        for group, table in enumerate(self._seq_tables(seq)):
            self.register(hashes, table, group)

    # -- allocation ---------------------------------------------------------------------

    def _seq_tables(self, seq: Sequence) -> list[list[int]]:
        tables = self._tables.get(seq.request_id)
        if tables is not None:
            return tables
        missing = self.num_groups - 1 - len(seq.group_block_tables)
        return [seq.block_table, *seq.group_block_tables, *([] for _ in range(missing))]

    def take(self, seq: Sequence, matched: list[int] | PrefixHit) -> None:
        """Start `seq`'s block tables with the matched prefix blocks (shared, ref counted)."""
        assert seq.request_id not in self._tables, f"{seq.request_id} already holds blocks"
        hit = self._as_hit(matched)
        tables = [list(t) for t in hit.tables]
        for group, table in enumerate(tables):
            for block_id in table:
                if block_id != self.null_block:
                    self._ref(block_id, group)
        self._adopt(seq, tables)

    def _adopt(self, seq: Sequence, tables: list[list[int]]) -> list[list[int]]:
        seq.block_table, *rest = tables
        seq.group_block_tables = rest
        seq.num_synced_blocks = 0
        seq.num_synced_group_blocks = [0] * len(rest)
        self._tables[seq.request_id] = tables
        self._num_null[seq.request_id] = [
            next((i for i, b in enumerate(t) if b != self.null_block), len(t))
            if self.null_block is not None else 0
            for t in tables
        ]  # fmt: skip
        return tables

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks_for(num_tokens)
        if self.num_groups == 1:
            return need - len(seq.block_table) <= len(self._free)
        return sum(max(0, need - len(t)) for t in self._seq_tables(seq)) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block tables to hold `num_tokens` tokens."""
        tables = self._tables.get(seq.request_id)
        if tables is None:
            assert not seq.block_table and not seq.group_block_tables, "tables never taken"
            tables = self._adopt(seq, [[] for _ in self.windows])
        assert tables[0] is seq.block_table, "block table replaced behind the manager's back"
        need = self.blocks_for(num_tokens)
        for group, table in enumerate(tables):
            for _ in range(need - len(table)):
                block_id, _ = self._free.popitem(last=False)
                block = self.blocks[block_id]
                if block.hash is not None:  # evict the cached KV it held
                    del self._cached[block.hash]
                    block.hash = None
                block.ref_count, block.group = 1, group
                self._in_use[group] += 1
                table.append(block_id)

    def release_skipped(self, seq: Sequence) -> int:
        """Return to the pool every block of `seq`'s sliding groups that lies wholly before
        the window of its next query (position num_computed_tokens): no later step reads
        it. Returns how many went back."""
        if not self._sliding:
            return 0
        tables = self._tables.get(seq.request_id)
        if tables is None:
            return 0
        nulls, freed = self._num_null[seq.request_id], 0
        for g in self._sliding:
            window, table = self.windows[g], tables[g]
            assert window is not None
            skip = min(max(0, seq.num_computed_tokens - window + 1) // self.block_size, len(table))
            if skip <= nulls[g]:
                continue
            for i in range(nulls[g], skip):
                self._unref(table[i])
                table[i] = self.null_block  # type: ignore[assignment]
            freed += skip - nulls[g]
            self._set_synced(seq, g, nulls[g])  # the runner gets the table from there
            nulls[g] = skip
        return freed

    def _set_synced(self, seq: Sequence, group: int, at_most: int) -> None:
        if group == 0:
            seq.num_synced_blocks = min(seq.num_synced_blocks, at_most)
        else:
            synced = seq.num_synced_group_blocks
            synced[group - 1] = min(synced[group - 1], at_most)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the blocks beyond `num_tokens` (rolling back rejected draft slots)."""
        keep = self.blocks_for(num_tokens)
        for group, table in enumerate(self._seq_tables(seq)):
            self._set_synced(seq, group, keep)
            while len(table) > keep:
                block_id = table.pop()
                assert block_id != self.null_block, f"{seq.request_id}: shrank into its window"
                self._unref(block_id)

    def free(self, seq: Sequence) -> None:
        tables = self._tables.pop(seq.request_id, None)
        self._num_null.pop(seq.request_id, None)
        seq.num_synced_blocks = 0
        seq.num_synced_group_blocks = [0] * len(seq.group_block_tables)
        if tables is None:
            return
        for table in tables:
            # Tail first: the end of a prompt is the least likely to be shared later.
            for block_id in reversed(table):
                if block_id != self.null_block:
                    self._unref(block_id)
            table.clear()

    def _ref(self, block_id: int, group: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count == 0 or block.group == group, f"block {block_id} in two groups"
        if block.ref_count == 0:
            del self._free[block_id]
            block.group = group
            self._in_use[group] += 1
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._in_use[block.group] -= 1
            self._free[block_id] = None
            if block.hash is None:  # nothing worth keeping: hand it out first
                self._free.move_to_end(block_id, last=False)

    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        in_use = [0] * self.num_groups
        for request_id, tables in self._tables.items():
            assert len(tables) == self.num_groups, f"{request_id}: {len(tables)} tables"
            for group, table in enumerate(tables):
                held = [b for b in table if b != self.null_block]
                assert len(set(held)) == len(held), f"{request_id} holds a block twice"
                nulls = len(table) - len(held)
                assert nulls == self._num_null[request_id][group], f"{request_id}: null count"
                assert all(b == self.null_block for b in table[:nulls]), (
                    f"{request_id}: a null entry after a held block in group {group}"
                )
                for block_id in held:
                    refs[block_id] += 1
                    assert self.blocks[block_id].group == group, f"block {block_id}: wrong group"
        for block in self.blocks:
            if block.block_id == self.null_block:
                assert block.ref_count == 0 and block.hash is None, "the null block was used"
                assert block.block_id not in self._free, "the null block is in the free queue"
                continue
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {refs[block.block_id]} tables"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: ref_count {block.ref_count} but "
                f"{'in' if block.block_id in self._free else 'not in'} the free queue"
            )
            if block.ref_count:
                in_use[block.group] += 1
        assert in_use == self._in_use, f"blocks in use per group {self._in_use}, held {in_use}"
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].hash == h, f"cache entry for block {block_id} is stale"
        assert sum(b.hash is not None for b in self.blocks) == len(self._cached)

import pytest

from scheduler.config import group_peak_blocks, kv_cache_groups
from scheduler.kv_blocks import BlockManager
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import Sequence
from scheduler.step_plan import BlockTableDelta, schedule_item


def make_seq(request_id: str, num_tokens: int, start: int = 0) -> Sequence:
    return Sequence(request_id, list(range(start, start + num_tokens)))


def test_grow_takes_blocks_in_order_and_free_returns_them():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", 6)
    bm.grow(seq, 6)
    assert seq.block_table == [0, 1]
    assert bm.num_free_blocks == 2
    bm.grow(seq, 9)
    assert seq.block_table == [0, 1, 2]
    bm.check_integrity()
    bm.free(seq)
    assert bm.num_free_blocks == 4 and seq.block_table == []
    bm.check_integrity()


def test_can_grow_counts_only_missing_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq("a", 4)
    bm.grow(seq, 4)
    assert bm.can_grow(seq, 8)
    assert not bm.can_grow(seq, 9)


def test_prefix_blocks_are_shared_and_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq("a", 10)
    bm.grow(a, 10)
    bm.register(extend_block_hashes(a, 10, 4), a.block_table)
    b = make_seq("b", 12)  # same first 10 tokens, 2 more
    matched = bm.match_prefix(extend_block_hashes(b, 12, 4))
    assert matched == a.block_table[:2]
    assert bm.cost_of(matched, 12) == 1  # both matched blocks are in use: only 1 new
    bm.take(b, matched)
    bm.grow(b, 12)
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_integrity()
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_freed_cached_blocks_stay_findable_until_reused_lru_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq("a", 4)
    bm.grow(a, 4)
    hashes = extend_block_hashes(a, 4, 2)
    bm.register(hashes, a.block_table)
    bm.free(a)
    # Still cached after the free; a matched free block costs one free block.
    again = make_seq("again", 4)
    matched = bm.match_prefix(extend_block_hashes(again, 4, 2))
    assert matched == [0, 1]
    assert bm.cost_of(matched, 4) == 2
    # A newcomer takes the uncached blocks first (2, 3), then evicts the cached ones
    # least recently freed first: a freed its tail (block 1) first, so block 1 goes first.
    c = make_seq("c", 6, start=100)
    bm.grow(c, 6)
    assert c.block_table == [2, 3, 1]
    assert bm.match_prefix(hashes) == [0]
    bm.check_integrity()


def test_shrink_rolls_back_tail_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", 4)
    bm.grow(seq, 13)
    assert len(seq.block_table) == 4
    bm.shrink(seq, 5)
    assert seq.block_table == [0, 1]
    assert bm.num_free_blocks == 2
    bm.check_integrity()


def test_integrity_catches_a_corrupted_ref_count():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq("a", 4)
    bm.grow(seq, 4)
    bm.blocks[0].ref_count = 2
    with pytest.raises(AssertionError, match="block 0"):
        bm.check_integrity()


def test_bad_geometry_is_rejected():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(num_blocks=0, block_size=4)


# -- hybrid KV: KV cache groups, sliding windows ------------------------------------------

GEMMA_12 = ([64] * 5 + [None]) * 2  # layers 5 and 11 global, the rest sliding


def test_kv_cache_groups_give_every_group_as_many_layers_as_the_rarest_kind():
    groups = kv_cache_groups(GEMMA_12)
    assert [(g.sliding_window, g.layers) for g in groups] == [
        (None, (5, 11)), (64, (0, 1)), (64, (2, 3)), (64, (4, 6)), (64, (7, 8)), (64, (9, 10)),
    ]  # fmt: skip
    # One kind: one group of every layer (the single table of a Llama).
    assert [g.layers for g in kv_cache_groups([None] * 4)] == [(0, 1, 2, 3)]
    # 26 layers, 5:1 with 4 global: six sliding groups, the last of 2 layers.
    sizes = [len(g.layers) for g in kv_cache_groups(([512] * 5 + [None]) * 4 + [512] * 2)]
    assert sizes == [4, 4, 4, 4, 4, 4, 2]


def test_peak_blocks_of_a_sliding_group_are_its_window_and_one_step():
    # window 64, blocks of 16, steps of 32 tokens: ceil((63 + 32) / 16) + 1 = 7
    assert group_peak_blocks(64, 16, 8192, 32) == 7
    assert group_peak_blocks(None, 16, 8192, 32) == 512
    assert group_peak_blocks(64, 16, 40, 32) == 3  # never more than the sequence has
    bm = BlockManager(100, 16, windows=(None, 64), max_step_tokens=32)
    assert bm.footprint(8192) == 512 + 7
    assert bm.max_tokens_within(40) == 33 * 16  # 33 full blocks + 7 sliding
    assert bm.footprint(bm.max_tokens_within(40)) <= 40 < bm.footprint(33 * 16 + 1)


def test_sliding_group_returns_blocks_outside_the_window_while_decoding():
    bm = BlockManager(num_blocks=16, block_size=4, windows=(None, 8), max_step_tokens=4)
    seq = make_seq("a", 10)
    bm.take(seq, bm.find_prefix([], 0))
    bm.grow(seq, 10)
    # Block 0 is the null block; the full group takes 1-3, the sliding group 4-6.
    assert seq.block_table == [1, 2, 3] and seq.group_block_tables == [[4, 5, 6]]
    for computed in range(10, 40):  # decode: position `computed` is the next query
        seq.num_computed_tokens = computed
        seq.token_ids.append(computed)
        bm.release_skipped(seq)
        # The query at p sees keys > p - 8: every block wholly before p - 7 is gone.
        skipped = max(0, computed - 7) // 4
        sliding = seq.group_block_tables[0]
        assert sliding[:skipped] == [0] * skipped and 0 not in sliding[skipped:]
        bm.grow(seq, computed + 1)
        assert bm.held_blocks(seq) - len(seq.block_table) <= group_peak_blocks(8, 4, 40, 1)
        bm.check_integrity()
    # 40 tokens: the full group holds 10 blocks, the sliding one blocks 8 and 9 only.
    assert len(seq.block_table) == 10 and bm.held_blocks(seq) == 10 + 2
    assert bm.num_free_blocks == 15 - 12  # the released blocks went back to the pool
    assert bm.blocks_in_use(0) == 10 and bm.blocks_in_use(1) == 2
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_usable_blocks == 15
    bm.check_integrity()


def test_released_entries_reach_the_runner_again():
    bm = BlockManager(num_blocks=16, block_size=4, windows=(None, 8))
    seq = make_seq("a", 12)
    bm.grow(seq, 12)
    assert schedule_item(seq, 12, True).group_block_tables == (BlockTableDelta(0, (4, 5, 6)),)
    seq.num_computed_tokens = 12
    bm.release_skipped(seq)  # (12 - 7) // 4 = 1 block out of the window
    bm.grow(seq, 13)
    item = schedule_item(seq, 1, True)
    # The released block 4 (uncached: first out of the free queue) now grows the full
    # group: one pool for both kinds. The sliding table goes again from its null entry.
    assert item.block_table == BlockTableDelta(3, (4,))
    assert item.group_block_tables == (BlockTableDelta(0, (0, 5, 6, 7)),)


def test_a_sliding_prefix_hit_needs_the_blocks_of_its_last_window():
    bm = BlockManager(num_blocks=32, block_size=4, windows=(None, 8))
    a = make_seq("a", 24)
    bm.grow(a, 24)
    hashes = extend_block_hashes(a, 24, 4)
    bm.register(hashes, a.block_table, 0)
    bm.register(hashes[:4], a.group_block_tables[0], 1)  # sliding blocks 4, 5 not cached
    b = make_seq("b", 30)  # a's 24 tokens and 6 more
    hit = bm.find_prefix(extend_block_hashes(b, 30, 4), 7)
    # The full group has all 6; the sliding one the run 2, 3 that a window of 8 needs at
    # position 16 (keys 9..15: blocks 2 and 3), so the hit is 4 blocks.
    assert hit.num_blocks == 4
    assert hit.tables == (tuple(a.block_table[:4]), (0, 0, *a.group_block_tables[0][2:4]))
    # Cut inside an image span (safe_end): searched again below it.
    cut = bm.find_prefix(extend_block_hashes(b, 30, 4), 7, lambda n: min(n, 10))
    assert cut.num_blocks == 2
    assert cut.tables == (tuple(a.block_table[:2]), tuple(a.group_block_tables[0][:2]))
    # 4 new blocks per group; the matched ones are held by a already (cost nothing).
    assert bm.cost_of(hit, 30) == (4 + 4 - 4) + (2 + 4 - 2)
    bm.take(b, hit)
    bm.grow(b, 30)
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_integrity()
    bm.free(a)
    bm.free(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 31


def test_a_sliding_group_never_matches_when_prefix_caching_is_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, windows=(None, 8))
    a = make_seq("a", 8)
    bm.grow(a, 8)
    bm.register_seq(extend_block_hashes(a, 8, 4), a)
    assert bm.find_prefix(extend_block_hashes(make_seq("b", 8), 8, 4), 1).num_blocks == 0

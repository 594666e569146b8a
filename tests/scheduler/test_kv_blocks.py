import pytest

from scheduler.kv_blocks import BlockManager
from scheduler.prefix_hash import extend_block_hashes
from scheduler.sequence import Sequence


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

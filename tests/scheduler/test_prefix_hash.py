from scheduler.prefix_hash import block_hash, extend_block_hashes
from scheduler.sequence import ImagePlaceholder, Sequence

IMAGE_TOKEN = 7


def image_seq(request_id: str, digest: bytes, question: list[int]) -> Sequence:
    tokens = [1, 2] + [IMAGE_TOKEN] * 8 + question
    return Sequence(request_id, tokens, [ImagePlaceholder(digest, list(range(2, 10)))])


def test_chain_depends_on_parent():
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [9, 9]), [1, 2])
    assert block_hash(None, [1, 2]) == block_hash(None, [1, 2])


def test_same_image_shares_blocks_across_questions():
    a = image_seq("a", b"img-1" * 4, [20, 21, 22, 23])
    b = image_seq("b", b"img-1" * 4, [30, 31, 32, 33])
    ha, hb = extend_block_hashes(a, 14, 4), extend_block_hashes(b, 14, 4)
    # Blocks 0-1 hold the prefix and image (positions 0-7); block 2 has image + question.
    assert len(ha) == 3
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]


def test_different_image_same_placeholder_ids_do_not_share():
    a = image_seq("a", b"img-1" * 4, [20])
    b = image_seq("b", b"img-2" * 4, [20])
    assert a.token_ids == b.token_ids
    ha, hb = extend_block_hashes(a, 8, 4), extend_block_hashes(b, 8, 4)
    assert ha[0] != hb[0]  # block 0 holds positions 2, 3 of the image


def test_hashes_are_extended_incrementally():
    seq = Sequence("a", list(range(10)))
    first = extend_block_hashes(seq, 8, 4)
    assert len(first) == 2
    seq.token_ids += [10, 11]
    assert extend_block_hashes(seq, 12, 4)[:2] == first
    assert len(seq.block_hashes) == 3

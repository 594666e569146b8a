import random

import pytest

from scheduler.ngram import NgramProposer
from scheduler.sequence import Sequence


def propose(tokens: list[int], num_drafts: int = 3, min_n: int = 1, max_n: int = 4):
    return NgramProposer(min_n, max_n).propose(Sequence("s", list(tokens)), num_drafts)


def reference(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Rescan: the longest suffix (n <= max_n) seen ending earlier, its latest occurrence,
    the tokens after it continued periodically."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == suffix]
        if ends:
            out = list(tokens)
            for k in range(num_drafts):
                out.append(out[ends[-1] + k])
            return tuple(out[len(tokens) :])
    return ()


def test_longest_suffix_wins_over_a_later_shorter_one():
    #        [1 2 3] 9 . [2 3] 7 . [1 2 3]
    tokens = [1, 2, 3, 9, 0, 2, 3, 7, 8, 1, 2, 3]
    assert propose(tokens) == (9, 0, 2)
    # With max_n = 2 only [2 3] is looked up, and its latest occurrence is followed by 7.
    assert propose(tokens, max_n=2) == (7, 8, 1)


def test_latest_occurrence_is_used():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose(tokens, min_n=2) == (2, 5, 6)


def test_min_n_and_no_match_give_no_drafts():
    assert propose([1, 2, 3, 1], min_n=2) == ()
    assert propose([1, 2, 3, 1], min_n=1) == (2, 3, 1)
    assert propose([1, 2, 3, 4]) == ()
    assert propose([7]) == ()
    assert propose([1, 2, 1], num_drafts=0) == ()


def test_a_loop_continues_periodically_past_the_end():
    assert propose([7, 8, 9, 7, 8, 9, 7, 8], num_drafts=5) == (9, 7, 8, 9, 7)
    assert propose([4, 4, 4], num_drafts=4) == (4, 4, 4, 4)  # overlapping occurrence


@pytest.mark.parametrize("seed", range(4))
def test_incremental_index_matches_a_rescan(seed):
    rng = random.Random(seed)
    proposer = NgramProposer(min_n=2, max_n=4)
    seq = Sequence("s", [rng.randrange(5) for _ in range(3)])
    for _ in range(200):
        num_drafts = rng.randrange(0, 6)
        assert proposer.propose(seq, num_drafts) == reference(seq.token_ids, num_drafts, 2, 4)
        # Sometimes several tokens arrive at once (accepted drafts), sometimes none.
        seq.token_ids += [rng.randrange(5) for _ in range(rng.choice([0, 1, 1, 3]))]


def test_drop_forgets_the_sequence():
    proposer = NgramProposer(1, 3)
    seq = Sequence("s", [1, 2, 1])
    assert proposer.propose(seq, 2) == (2, 1)
    proposer.drop("s")
    # A new sequence under the same id starts from scratch (a stale index would assert).
    assert proposer.propose(Sequence("s", [9, 9]), 1) == (9,)

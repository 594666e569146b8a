"""n-gram draft proposer (prompt lookup, article §15): guess a sequence's next tokens by
finding its current suffix earlier in its own tokens (prompt + output) and proposing what
followed it there.

Rule: the longest suffix of n tokens, n from `max_n` down to `min_n`, that also ends at
an earlier position; among its earlier occurrences the LATEST one (the most recent
context is the best predictor of a copy or a loop). The proposal is the tokens that
followed that occurrence, read on into the proposal itself when it runs past the end:
for a suffix that repeats with period p the drafts continue the period.

Cost: each sequence keeps an incremental index (one dict per n, n-gram -> latest end
position) that is brought up to date with only the tokens appended since its last use,
so a step costs O(max_n²) per sequence plus O(max_n²) per new token: linear in the
sequence's length overall, never a rescan.
"""

from __future__ import annotations

from collections.abc import Sequence as TokenList

from scheduler.sequence import Sequence


class NgramIndex:
    """For each n in [min_n, max_n]: n-gram -> the latest end e (exclusive) of an
    occurrence with e < len(tokens), so at least one token followed it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._latest: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        # Invariant: every n-gram ending at e < num_indexed is in the index.
        self.num_indexed = 0

    def update(self, tokens: TokenList[int]) -> None:
        """Index the n-grams that end before the last token (each is followed by one)."""
        assert len(tokens) >= self.num_indexed, "tokens shrank under the n-gram index"
        for end in range(max(self.num_indexed, 1), len(tokens)):
            for n, table in self._latest.items():
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
        self.num_indexed = max(self.num_indexed, len(tokens))

    def lookup(self, tokens: TokenList[int]) -> tuple[int, int] | None:
        """(n, end) of the longest suffix of `tokens` seen earlier, or None. `tokens` must
        be the sequence last passed to `update`."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self._latest[n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return n, end
        return None


def continuation(tokens: TokenList[int], end: int, num_drafts: int) -> tuple[int, ...]:
    """The `num_drafts` tokens that followed position `end`, continued periodically past
    the end of `tokens` (the match at `end` predicts its own continuation)."""
    drafts: list[int] = []
    for k in range(num_drafts):
        i = end + k
        drafts.append(tokens[i] if i < len(tokens) else drafts[i - len(tokens)])
    return tuple(drafts)


class NgramProposer:
    """Per-sequence n-gram indexes, keyed by request id; `drop` when a sequence ends."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, f"need 1 <= min_n <= max_n, got {min_n}, {max_n}"
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, seq: Sequence, num_drafts: int) -> tuple[int, ...]:
        """Up to `num_drafts` guessed next tokens of `seq` (empty when nothing matches)."""
        if num_drafts <= 0:
            return ()
        index = self._indexes.get(seq.request_id)
        if index is None:
            index = self._indexes[seq.request_id] = NgramIndex(self.min_n, self.max_n)
        index.update(seq.token_ids)
        match = index.lookup(seq.token_ids)
        if match is None:
            return ()
        return continuation(seq.token_ids, match[1], num_drafts)

    def drop(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

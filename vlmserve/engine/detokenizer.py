"""Incremental detokenisation and stop strings: text grows by the new tokens only.

Decoding the whole output every step (and searching all of it for stop strings) is
O(n²) per request. Here each token decodes a short window instead, vLLM's offsets
scheme: `decode(ids[prefix:])` minus `decode(ids[prefix:read])`, where `prefix..read`
are the tokens behind the last emitted text. The window gives a token its left context
(a SentencePiece word's leading space, a tokenizer's clean-up rules), and a window that
ends in U+FFFD (a UTF-8 character split across byte-level tokens) emits nothing until
the character completes. Stop strings are searched only across the new text plus the
longest stop string's length - 1 characters before it.

What must stay true: `text` is the concatenation of every delta `add` returned, cut at
the first stop string; `take_delta` hands out each character once, holding back the
characters that a later token could still turn into a stop string.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class _RustDecoder:
    """A `tokenizers.Tokenizer` behind the `Decoder` protocol."""

    def __init__(self, backend: object) -> None:
        self._decode = backend.decode

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._decode(token_ids, skip_special_tokens=skip_special_tokens)


def direct_decoder(tokenizer: Decoder, backend: object | None = None) -> Decoder:
    """The Rust decoder under a transformers fast tokenizer (or `backend`, a private copy
    of it) where its `decode` returns exactly that decoder's text (the base class's
    decode, no clean-up pass), else the tokenizer itself. Each token decodes two short
    windows, and transformers' Python wrapper around the Rust call costs about 3x the
    call: on a batch of 64 that is most of the engine thread's per-token detokenising
    time."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return _RustDecoder(backend if backend is not None else tokenizer.backend_tokenizer)
    return tokenizer


class IncrementalDetokenizer:
    """One request's output text, fed one token at a time."""

    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        # Stop strings end only after the text of the first min_tokens tokens (vLLM's rule).
        self.min_tokens = min_tokens
        self._stop_from = 0
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string matched: `text` ends where it began
        self._prefix = 0  # token offsets of the decode window (see the module doc)
        self._read = 0
        self._sent = 0  # characters of `text` already handed out by take_delta

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text it completes ('' while a character is split
        or for a skipped special token). After a stop string matched, adds nothing."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        window = self.token_ids[self._prefix :]
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(window)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.token_ids)
        start = len(self.text)
        self.text += delta
        if self.stop and len(self.token_ids) > self.min_tokens:
            self._cut_at_stop(max(start, self._stop_from))
        elif self.stop:
            self._stop_from = len(self.text)
        return self.text[start:]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _cut_at_stop(self, start: int) -> None:
        # A match must end inside the new text, so it starts at most max_stop_len - 1
        # characters before it.
        begin = max(0, start - self.max_stop_len + 1)
        cuts = [c for c in (self.text.find(s, begin) for s in self.stop) if c >= 0]
        if cuts:
            self.text = self.text[: min(cuts)]
            self.stopped = True

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet. Until `finished`, the last max_stop_len - 1
        characters are held back: a stop string beginning there would cut them."""
        end = len(self.text)
        if not finished and self.max_stop_len:
            end -= self.max_stop_len - 1
        if end <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent : end], end
        return delta

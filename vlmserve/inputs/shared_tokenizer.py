"""Tokenising on several threads at once with nothing made on a request's path.

HF tokenizers are not safe to share across threads as transformers calls them: its
wrapper may reconfigure the Rust object on a call (truncation, padding, special-token
splitting: "Already borrowed" when another thread is encoding), and a lock would let one
huge prompt hold up every other request's tokenisation. Two ways out, neither built on a
request's first use:
- `direct_encoder`: one private Rust `tokenizers.Tokenizer`, configured once and never
  changed, whose `encode` (a shared borrow in the Rust binding, as its own `encode_batch`
  uses across threads) every thread calls at once; used where it gives exactly the ids
  the wrapper gives (checked on probe texts at start-up). vLLM keeps one tokenizer too
  (its server tokenises on one thread, micro-batched).
- `CopyPool`: ready deep copies, one borrowed per call, for the rest (slow tokenizers,
  processors, a wrapper with Python-side encoding); `fill` makes them at start-up (the
  warm-up), since a deep copy of a 262,144-token tokenizer takes about 2 s and holds the
  GIL.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

# Threads that prepare requests at once (the server's preparers): the pools' size.
NUM_PREPARE_THREADS = 4

Encoder = Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> token ids

_PROBES = ("Hello, world!", " two  spaces\nand a line", "naïve café 東京 🙂", "")


class CopyPool(Generic[T]):
    """Deep copies of an object, each used by one thread at a time. `borrow` takes a free
    copy, makes one while fewer than `size` exist (first use: what `fill` avoids), else
    waits for one to come back."""

    def __init__(self, obj: T, size: int = NUM_PREPARE_THREADS) -> None:
        assert size >= 1, "a pool needs a copy"
        self._original = obj
        self.size = size
        self._free: list[T] = []
        self._num_made = 0
        self._cond = threading.Condition()

    @property
    def num_made(self) -> int:
        return self._num_made

    def fill(self) -> None:
        """Make every copy now (start-up), so that no borrower makes one."""
        while True:
            with self._cond:
                if self._num_made >= self.size:
                    return
                self._num_made += 1
            made = copy.deepcopy(self._original)
            with self._cond:
                self._free.append(made)
                self._cond.notify()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[T]:
        with self._cond:
            while not self._free and self._num_made >= self.size:
                self._cond.wait()
            mine = self._free.pop() if self._free else None
            if mine is None:
                self._num_made += 1
        if mine is None:  # first use without `fill`
            mine = copy.deepcopy(self._original)
        try:
            yield mine
        finally:
            with self._cond:
                self._free.append(mine)
                self._cond.notify()


class RustEncoder:
    """A private `tokenizers.Tokenizer` behind the `Encoder` signature: no truncation, no
    padding, never reconfigured after construction, so any thread may call it."""

    def __init__(self, backend: object) -> None:
        self.backend = backend  # also decodes from any thread (its `decode` reads only)
        self._encode = backend.encode

    def __call__(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._encode(text, add_special_tokens=add_special_tokens).ids


def direct_encoder(tokenizer: object) -> RustEncoder | None:
    """A thread-safe encoder giving exactly `tokenizer(text, add_special_tokens=...)`'s
    input ids, over a private copy of its Rust tokenizer; None where the tokenizer is not
    a transformers fast tokenizer on the base class's encode path, or the ids differ on
    the probes (its own special tokens among them)."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    if not (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.__call__ is PreTrainedTokenizerBase.__call__
        and cls._encode_plus is PreTrainedTokenizerFast._encode_plus
    ):
        return None
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    encoder = RustEncoder(backend)
    specials = " ".join(str(t) for t in getattr(tokenizer, "all_special_tokens", ())[:8])
    for text in (*_PROBES, f"{specials} after the special tokens {specials}"):
        for add_special in (False, True):
            want = tokenizer(text, add_special_tokens=add_special)["input_ids"]
            if encoder(text, add_special) != list(want):
                return None
    return encoder

"""The engine's grammar compiler, made on its first constrained request."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class LazyGrammars:
    """An engine's grammar compiler (`vlmserve.sample.grammar.Grammars`), made on the first
    constrained request: xgrammar takes seconds to import, and engines that never see a
    constraint never pay it. `get` is safe from any thread (preparer threads call it)."""

    def __init__(
        self, tokenizer: object, vocab_size: int, stop_token_ids: Iterable[int], config: object
    ) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids, config.structured)
        self._lock = threading.Lock()
        self._grammars = None

    def get(self):  # -> vlmserve.sample.grammar.Grammars
        with self._lock:
            if self._grammars is None:
                from vlmserve.sample.grammar import Grammars

                self._grammars = Grammars(*self._args)
            return self._grammars

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()

"""The engine's grammar compiler: made by the warm-up (before serving), else on the
first constrained request."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class LazyGrammars:
    """An engine's grammar compiler (`vlmserve.sample.grammar.Grammars`), made by `warm`
    (the warm-up `serve` runs) or on the first constrained request: xgrammar takes seconds
    to import, and an engine without the warm-up that never sees a constraint never pays
    it. `get` is safe from any thread (preparer threads call it)."""

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

    def warm(self) -> None:
        """Import xgrammar and build its tokenizer tables now, on the thread that owns the
        tokenizer (the engine's, in the warm-up): no request waits for them."""
        self.get().warm()

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()

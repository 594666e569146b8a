"""Structured outputs with xgrammar (the library vLLM and SGLang use): compiling a
request's constraint off the engine thread, and its matcher.

- Compile: `Grammars.submit` hands the spec to a small thread pool and returns a future;
  the request waits in the queue like one whose image is decoding (`RequestGrammar.ready`
  is polled by the engine, never waited on), so a step is never blocked. Compiled grammars
  are cached by spec (an LRU of futures: concurrent requests with one schema share one
  compile). An invalid spec, or one still compiling after `compile_timeout_s`, fails its
  request with a 400.
- Each step (`vlmserve.sample.masks`) fills one bitmask for the constrained rows beside
  the forward pass, applies it where the logits are, and advances the matchers.
What must stay true: a matcher sees exactly the tokens its request emitted, in order.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from encoders.errors import RequestError
from vlmserve.sample.structured import StructuredConfig, StructuredOutput

_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(RequestError):
    """A constraint that cannot be compiled or followed (400, naming the problem)."""


class Grammars:
    """Compiles constraints for one tokenizer on `num_compile_threads` threads, cached.
    xgrammar's tokenizer tables (seconds for a 262,144-token vocabulary) are built by
    `warm` (the engine's warm-up, before serving), else on the first compile (on the pool,
    from a copy of the tokenizer: the caller keeps using its own)."""

    def __init__(
        self,
        tokenizer: object,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        config: StructuredConfig | None = None,
    ) -> None:
        self.config = config or StructuredConfig()
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer  # the caller's: read only by `warm`, on its thread
        self._stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(self.config.num_compile_threads, "vlmserve-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # not _lock: a submit never waits on tables
        self.num_compiles = 0
        self.num_cache_hits = 0

    def submit(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, as a future (done at once when cached)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.num_cache_hits += 1
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            self.num_compiles += 1
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
            return future

    def request(self, spec: StructuredOutput) -> RequestGrammar:
        """A request's grammar: its compile started, its matcher made once compiled."""
        return RequestGrammar(self.submit(spec), self.config.compile_timeout_s)

    def warm(self) -> None:
        """Build the tokenizer tables now, on the calling thread (the tokenizer's owner)."""
        self._compiler_now(copy_tokenizer=False)

    def _compiler_now(self, copy_tokenizer: bool = True) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                tokenizer = copy.deepcopy(self._tokenizer) if copy_tokenizer else self._tokenizer
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None,
                )  # fmt: skip
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._compiler_now()
        try:
            if spec.kind in ("json", "json_object"):  # any object: extra properties allowed
                schema = spec.spec if spec.kind == "json" else '{"type": "object"}'
                ebnf = _json_grammar(schema, self.config.any_whitespace, spec.kind == "json")
                return compiler.compile_grammar(ebnf)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                alternatives = " | ".join(_ebnf_literal(c) for c in spec.choices)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(spec.spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and friends
            # xgrammar's messages start with "[time] file.cc:line: ": keep what follows.
            message = _SOURCE_PREFIX.sub("", " ".join(str(e).split()))[:500]
            what = {"json": "JSON schema", "grammar": "EBNF grammar"}.get(spec.kind, spec.kind)
            raise GrammarError(f"invalid {what}: {message or type(e).__name__}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# xgrammar 0.2 writes a JSON string's characters as one of these classes: a maxLength
# string's lets raw control characters through (invalid JSON: `json.loads` and pydantic
# refuse it), and both let UTF-16 surrogates through (invalid UTF-8). Ours keeps both out.
# (A `pattern` that spells the same out as a bounded repetition fills 10-100x slower.)
_XGRAMMAR_STRING_CHARS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\ud800-\\udfff]'


def _json_grammar(schema: str, any_whitespace: bool, strict: bool) -> str:
    """The EBNF of a JSON schema, its string characters valid JSON and UTF-8."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace,
                                            strict_mode=strict))  # fmt: skip
    for chars in _XGRAMMAR_STRING_CHARS:
        ebnf = ebnf.replace(chars, _JSON_STRING_CHAR)
    return ebnf


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: JSON's escapes, which xgrammar's EBNF reads."""
    return json.dumps(text, ensure_ascii=False)


class RequestGrammar:
    """One request's constraint: its compile, then its matcher."""

    def __init__(self, future: Future[xgr.CompiledGrammar], timeout_s: float) -> None:
        self.future = future
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.matcher: xgr.GrammarMatcher | None = None
        # Mirrors matcher.is_terminated() (tests check it), read without a call per step.
        self.terminated = False
        self.stop_token_ids: frozenset[int] = frozenset()

    def fork(self) -> RequestGrammar:
        """Another request's constraint on the same compile (n > 1 children): the compile
        and its deadline shared, a matcher of its own."""
        twin = RequestGrammar(self.future, self.timeout_s)
        twin.deadline = self.deadline
        return twin

    def ready(self) -> bool:
        """True once the matcher exists; False while compiling. Raises GrammarError for a
        spec that failed to compile or is still compiling past its deadline. Never blocks."""
        if self.matcher is not None:
            return True
        if not self.future.done():
            if time.monotonic() > self.deadline:
                raise GrammarError(
                    f"compiling the constraint took longer than {self.timeout_s:g} s "
                    "(simplify the schema or grammar)"
                )
            return False
        matcher = xgr.GrammarMatcher(self.future.result())  # raises GrammarError
        self.stop_token_ids = frozenset(matcher.stop_token_ids)
        self.matcher = matcher
        return True

    @property
    def live(self) -> bool:
        """Still constraining: compiled and not terminated (it accepted a stop token)."""
        return self.matcher is not None and not self.terminated

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance over emitted tokens; tokens after termination (the async step's extra
        token of a finished request) are ignored."""
        assert self.matcher is not None, "a request steps only once its grammar is ready"
        for token in tokens:
            if self.terminated:
                return
            if not self.matcher.accept_token(token):
                raise GrammarError(f"token {token} does not continue the constrained output")
            self.accepted(token)

    def accepted(self, token: int) -> None:
        """Book a token the matcher accepted: a stop token terminates it (xgrammar's own
        rule, without `terminate_without_stop_token`), kept here so that a step asks the
        matcher nothing per row (each call into xgrammar drops and retakes the GIL)."""
        if token in self.stop_token_ids:
            self.terminated = True

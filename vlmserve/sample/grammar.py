"""Structured outputs with xgrammar (the library vLLM and SGLang use): compiling a
request's constraint off the engine thread, its matcher, and the token bitmask of a step.

- Compile: `Grammars.submit` hands the spec to a small thread pool and returns a future;
  the request waits in the queue like one whose image is decoding (`RequestGrammar.ready`
  is polled by the engine, never waited on), so a step is never blocked. Compiled grammars
  are cached by spec (an LRU of futures: concurrent requests with one schema share one
  compile). An invalid spec, or one still compiling after `compile_timeout_s`, fails its
  request with a 400.
- Each step, `constrain_logits` fills one bitmask for the constrained rows (one batched
  fill on xgrammar's threads) and sets the refused tokens' logits to -inf in place, where
  the logits are, before the batched sampler. Unconstrained rows are never touched.
- A speculating row's drafts are walked through the matcher first: row k gets the mask
  after drafts[:k], so a draft the grammar refuses has probability 0 and is rejected by
  verification (losslessly: the kept tokens are those plain constrained decoding draws);
  the matcher is rolled back, then `advance_grammars` feeds it the tokens really emitted.
What must stay true: a matcher sees exactly the tokens its request emitted, in order.
The matchers are touched only by the thread that samples (steps run one at a time, in
order), so with async scheduling step i+1 fills its mask after step i's token is in.
Preemption recomputes KV but keeps the tokens, so the matcher keeps its state.
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
from typing import NamedTuple

import torch
import xgrammar as xgr

from encoders.errors import RequestError
from vlmserve.sample.structured import StructuredConfig, StructuredOutput

_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(RequestError):
    """A constraint that cannot be compiled or followed (400, naming the problem)."""


class Grammars:
    """Compiles constraints for one tokenizer on `num_compile_threads` threads, cached.
    xgrammar's tokenizer tables are built on the first compile (on the pool too)."""

    def __init__(
        self,
        tokenizer: object,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        config: StructuredConfig | None = None,
    ) -> None:
        self.config = config or StructuredConfig()
        self.vocab_size = vocab_size
        self._tokenizer = copy.deepcopy(tokenizer)  # the pool's own: tokenizers share nothing
        self._stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(self.config.num_compile_threads, "vlmserve-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._compiler: xgr.GrammarCompiler | None = None
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

    def _compiler_now(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
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
        self.matcher = xgr.GrammarMatcher(self.future.result())  # raises GrammarError
        return True

    @property
    def live(self) -> bool:
        """Still constraining: compiled and not terminated (it accepted a stop token)."""
        return self.matcher is not None and not self.matcher.is_terminated()

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance over emitted tokens; tokens after termination (the async step's extra
        token of a finished request) are ignored."""
        assert self.matcher is not None, "a request steps only once its grammar is ready"
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(token):
                raise GrammarError(f"token {token} does not continue the constrained output")


class StepMasks(NamedTuple):
    """A step's filled bitmask ([num_rows, ceil(vocab / 32)] int32, host) and, per
    constrained group (by index), the logits rows filled for it."""

    bitmask: torch.Tensor
    filled: list[tuple[int, list[int]]]


def fill_masks(groups: Sequence[object], num_rows: int, vocab: int) -> StepMasks | None:
    """Fill the bitmask rows of every constrained group of a step (None: there are none).
    Reads only the matchers, so it may run beside the forward pass (`start_fill`)."""
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab)
    plain: list[xgr.GrammarMatcher] = []
    plain_rows: list[int] = []
    filled: list[tuple[int, list[int]]] = []  # (group index, its filled rows)
    for i, group in enumerate(groups):
        grammar = group.state.grammar
        if grammar is None or not grammar.live:
            continue
        if not group.draft_token_ids:
            plain.append(grammar.matcher)
            plain_rows.append(group.first_row)
            filled.append((i, [group.first_row]))
        else:
            filled.append((i, _fill_with_drafts(grammar.matcher, bitmask, group)))
    if not filled:
        return None
    if plain:  # one call: xgrammar fills the rows on its own threads
        _batch().batch_fill_next_token_bitmask(plain, bitmask, plain_rows)
    return StepMasks(bitmask, filled)


def start_fill(groups: Sequence[object], num_rows: int, vocab: int) -> Future[StepMasks | None]:
    """`fill_masks` on the fill thread: it runs while the forward pass computes the logits
    (xgrammar drops the GIL), as SGLang and vLLM overlap it."""
    return _FILL.submit(fill_masks, groups, num_rows, vocab)


_FILL = ThreadPoolExecutor(1, "vlmserve-grammar-fill")


def apply_masks(logits: torch.Tensor, masks: StepMasks | None) -> dict[int, Exception]:
    """Set to -inf, in place, the logits of tokens each constrained row's grammar refuses.
    Returns the groups (by index) that cannot go on: no token of the vocabulary continues
    them. Unconstrained rows are never touched."""
    if masks is None:
        return {}
    rows = [row for _, group_rows in masks.filled for row in group_rows]
    # The sampling rows come first; rows after them (prompt logprobs) are not masked.
    logits = logits[: masks.bitmask.shape[0]]
    allowed_any = masks.bitmask.index_select(0, torch.tensor(rows)).ne(0).any(-1).tolist()
    xgr.apply_token_bitmask_inplace(
        logits, masks.bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[-1],
        indices=rows,
    )  # fmt: skip
    dead: dict[int, Exception] = {}
    flags = iter(allowed_any)
    for i, group_rows in masks.filled:
        if not all([next(flags) for _ in group_rows]):
            dead[i] = GrammarError(
                "no token of this model's vocabulary continues the constrained output "
                "(its tokenizer cannot write what the constraint requires)"
            )
    return dead


def constrain_logits(logits: torch.Tensor, groups: Sequence[object]) -> dict[int, Exception]:
    """Fill and apply at once (`apply_masks(logits, fill_masks(...))`). groups: the step's
    `RowGroup`s (state.grammar is a RequestGrammar or None)."""
    return apply_masks(logits, fill_masks(groups, *logits.shape))


def _batch() -> xgr.BatchGrammarMatcher:
    # One per process: it is a pool of threads that fill rows.
    global _BATCH
    if _BATCH is None:
        _BATCH = xgr.BatchGrammarMatcher()
    return _BATCH


_BATCH: xgr.BatchGrammarMatcher | None = None


def _fill_with_drafts(matcher: xgr.GrammarMatcher, bitmask: torch.Tensor, group) -> list[int]:
    """Fill row k with the mask after drafts[:k], up to the first draft the grammar
    refuses (that draft then has probability 0 and is rejected; later rows are unused),
    then roll the matcher back. Returns the rows filled."""
    rows = []
    num_accepted = 0
    for k in range(len(group.draft_token_ids) + 1):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, group.first_row + k)
        rows.append(group.first_row + k)
        if k == len(group.draft_token_ids) or not matcher.accept_token(group.draft_token_ids[k]):
            break
        num_accepted += 1
    if num_accepted:
        matcher.rollback(num_accepted)
    return rows


def advance_grammars(
    groups: Sequence[object], emitted: list[list[int] | Exception], dead: dict[int, Exception]
) -> list[list[int] | Exception]:
    """Feed each constrained group's matcher the tokens it emitted (per group, as
    `sample_plan` computes them); a group that cannot go on gets its error instead."""
    out = list(emitted)
    for i, group in enumerate(groups):
        grammar = group.state.grammar
        if i in dead:  # its row was all -inf: the sampler's error says less
            out[i] = dead[i]
            continue
        if grammar is None or isinstance(out[i], Exception):
            continue
        try:
            grammar.accept(out[i])
        except GrammarError as e:
            out[i] = e
    return out

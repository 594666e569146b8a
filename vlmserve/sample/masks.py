"""A step's grammar masks (structured outputs): filled beside the forward pass, applied to
the constrained rows' logits before the batched sampler, and the matchers advanced on the
tokens the step emitted. The matchers and compiles are `vlmserve.sample.grammar`'s.

- Fill: `start_fill` splits the step's constrained rows into chunks and starts the fill
  threads on them as the forward pass starts (the mask needs only the tokens before the
  step, the logits are needed only to apply it). Each chunk is one call into xgrammar,
  which drops the GIL for all of it: nothing here calls it per row. When its forward is
  done, the sampling thread takes the chunks still left itself (`FillJob.result`), so a
  fill longer than the forward is shared between two cores, not waited for on one.
  Bitmask buffers are reused from step to step.
- Apply: one pass over each constrained row (kernels/sampling_cpu on CPU float32
  logits; xgrammar's kernel elsewhere), which also says which rows allow no token at all.
- Advance: the rows that emitted one token (all, but for speculation) advance in one call;
  termination is booked by `RequestGrammar.accepted`, never asked of the matcher per row.
- Speculation: a row's drafts are walked through its matcher, row k masked after
  drafts[:k], up to the first draft it refuses (that draft then has probability 0 and is
  rejected by verification, losslessly); the matcher is rolled back before `advance`.
What must stay true: a matcher sees exactly the tokens its request emitted, in order. A
step's fill starts after the step before it advanced its matchers (steps run one at a
time, on one thread, and the fill of a step is done before it samples), so with async
scheduling step i+1 fills after step i's token is in. Preemption keeps the tokens, so the
matcher keeps its state.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import xgrammar as xgr

from kernels import sampling_cpu
from vlmserve.sample.grammar import GrammarError, RequestGrammar

# As xgrammar's own batch fill ("auto": half the cores), at most 8; the sampling thread
# joins them once its forward is done.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
NUM_FILL_THREADS = max(1, min(8, (_CORES or 1) // 2))
MIN_CHUNK_ROWS = 4


class StepMasks(NamedTuple):
    """A step's filled bitmask ([>= num_rows, ceil(vocab / 32)] int32, host; only the filled
    rows are meaningful) and, per constrained group (by index), the logits rows filled."""

    bitmask: torch.Tensor
    filled: list[tuple[int, list[int]]]


class FillJob:
    """One step's fill, as chunks that the fill threads and then the sampling thread take
    in turn (each chunk once). `result()` returns once every chunk is filled."""

    def __init__(self, groups: Sequence[object], num_rows: int, vocab: int) -> None:
        self.filled: list[tuple[int, list[int]]] = []  # (group index, its filled rows)
        self._chunks: collections.deque[Callable[[], None]] = collections.deque()
        self._done = threading.Condition()
        self._num_left = self.num_chunks = 0
        self._error: BaseException | None = None
        self.bitmask: torch.Tensor | None = None
        plain: list[tuple[xgr.GrammarMatcher, int]] = []
        for i, group in enumerate(groups):
            grammar = group.state.grammar
            if grammar is None or not grammar.live:
                continue
            if group.draft_token_ids:  # a chunk of its own, walked row by row; its rows
                self.filled.append((i, []))  # are those it really fills
                self._chunks.append(self._drafts_chunk(len(self.filled) - 1, grammar, group))
            else:
                plain.append((grammar.matcher, group.first_row))
                self.filled.append((i, [group.first_row]))
        if not self.filled:
            return
        self.bitmask = _BITMASKS.take(num_rows, vocab)
        # Chunks small enough for the workers to share, large enough to pay the call.
        size = max(MIN_CHUNK_ROWS, -(-len(plain) // (4 * (NUM_FILL_THREADS + 1))))
        for start in range(0, len(plain), size):
            self._chunks.append(self._plain_chunk(plain[start : start + size]))
        self._num_left = self.num_chunks = len(self._chunks)

    def _plain_chunk(self, rows: list[tuple[xgr.GrammarMatcher, int]]) -> Callable[[], None]:
        matchers, indices = [m for m, _ in rows], [r for _, r in rows]
        return lambda: _SERIAL.batch_fill_next_token_bitmask(matchers, self.bitmask, indices)

    def _drafts_chunk(self, k: int, grammar: RequestGrammar, group) -> Callable[[], None]:
        def fill() -> None:
            rows = _fill_with_drafts(grammar.matcher, self.bitmask, group)
            self.filled[k] = (self.filled[k][0], rows)

        return fill

    def work(self) -> None:
        """Fill chunks until none is left to take."""
        while True:
            try:
                chunk = self._chunks.popleft()
            except IndexError:
                return
            try:
                chunk()
            except BaseException as e:  # noqa: BLE001 - raised again by result()
                self._error = e
            with self._done:
                self._num_left -= 1
                if self._num_left == 0:
                    self._done.notify_all()

    def finish(self) -> None:
        """Returns once every chunk is filled, taking the chunks left first."""
        self.work()
        with self._done:
            self._done.wait_for(lambda: self._num_left == 0)

    def result(self) -> StepMasks | None:
        """The filled masks (None: no constrained row)."""
        self.finish()
        if self._error is not None:
            raise self._error
        return StepMasks(self.bitmask, self.filled) if self.bitmask is not None else None


def start_fill(groups: Sequence[object], num_rows: int, vocab: int) -> FillJob:
    """Start filling a step's masks on the fill threads: they run while the forward pass
    computes the logits, as SGLang and vLLM overlap them; `result()` finishes the job."""
    job = _new_job(groups, num_rows, vocab)
    for _ in range(min(NUM_FILL_THREADS, job.num_chunks)):
        _FILL.submit(job.work)
    return job


def fill_masks(groups: Sequence[object], num_rows: int, vocab: int) -> StepMasks | None:
    """Fill a step's masks on this thread alone (None: there are none)."""
    return _new_job(groups, num_rows, vocab).result()


def _new_job(groups: Sequence[object], num_rows: int, vocab: int) -> FillJob:
    global _LAST
    with _LAST_LOCK:
        # A step whose forward failed never took its result: its chunks may still be
        # filling, and a matcher must not fill on two threads at once.
        if _LAST is not None:
            _LAST.finish()
        _LAST = FillJob(groups, num_rows, vocab)
        return _LAST


_LAST: FillJob | None = None
_LAST_LOCK = threading.Lock()


_FILL = ThreadPoolExecutor(NUM_FILL_THREADS, "vlmserve-grammar-fill")
# A chunk's rows one after the other in one call (the threads are ours).
_SERIAL = xgr.BatchGrammarMatcher(max_threads=1)


class _Bitmasks:
    """Bitmask buffers reused from step to step (a step takes one, `apply_masks` gives it
    back). A free list, not one buffer: engines in one process share the fill threads, and
    a step whose forward failed never gives its buffer back. Rows are not reset between
    steps: a fill writes every word of the rows it fills, and only those are read."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, num_rows: int, vocab: int) -> torch.Tensor:
        num_words = (vocab + 31) // 32
        with self._lock:
            for k, buffer in enumerate(self._free):
                if buffer.shape[0] >= num_rows and buffer.shape[1] == num_words:
                    return self._free.pop(k)
        # Pageable host memory on purpose: a copy to a GPU returns only once it has read
        # the buffer, so the next step may refill it at once.
        return xgr.allocate_token_bitmask(max(num_rows, 64), vocab)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < 4:
                self._free.append(buffer)


_BITMASKS = _Bitmasks()


def apply_masks(logits: torch.Tensor, masks: StepMasks | None) -> dict[int, Exception]:
    """Set to -inf, in place, the logits of tokens each constrained row's grammar refuses.
    Returns the groups (by index) that cannot go on: no token of the vocabulary continues
    them. Unconstrained rows are never touched."""
    if masks is None:
        return {}
    # Only the filled rows are touched: the rows after the sampling ones (prompt logprobs)
    # and the rows of unconstrained groups keep their logits.
    rows = [row for _, group_rows in masks.filled for row in group_rows]
    bitmask = masks.bitmask
    if sampling_cpu.can_run(logits):  # one pass a row, and whether it allows any token
        allowed_any = sampling_cpu.apply_token_bitmask_(logits, bitmask, rows)
    else:  # a GPU (xgrammar's Triton kernel), or no C++ build
        allowed_any = bitmask.index_select(0, torch.tensor(rows)).ne(0).any(-1).tolist()
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[-1],
            indices=rows,
        )  # fmt: skip
    _BITMASKS.give_back(bitmask)
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
    `sample_plan` computes them); a group that cannot go on gets its error instead. The
    groups that emitted one token (all, but for speculation) advance in one call."""
    out = list(emitted)
    one: list[tuple[int, RequestGrammar, int]] = []  # (group index, grammar, its token)
    for i, group in enumerate(groups):
        grammar = group.state.grammar
        if i in dead:  # its row was all -inf: the sampler's error says less
            out[i] = dead[i]
            continue
        if grammar is None or isinstance(out[i], Exception):
            continue
        if len(out[i]) == 1 and grammar.live:
            one.append((i, grammar, out[i][0]))
            continue
        try:
            grammar.accept(out[i])
        except GrammarError as e:
            out[i] = e
    if one:
        oks = xgr.BatchGrammarMatcher.batch_accept_token(
            [grammar.matcher for _, grammar, _ in one], [token for _, _, token in one]
        )
        for (i, grammar, token), ok in zip(one, oks, strict=True):
            if ok:
                grammar.accepted(token)
            else:
                out[i] = GrammarError(f"token {token} does not continue the constrained output")
    return out

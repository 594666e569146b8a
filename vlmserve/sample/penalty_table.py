"""The penalties' per-request state, kept incrementally where the logits are (vLLM's
`PenaltiesState` in its v2 model runner): one row per request of two tensors,

- `prompt` [rows, vocab] bool: which ids the prompt holds, set once, at the request's
  first penalised step (the repetition penalty reads it);
- `counts` [rows, vocab] int32: how often each id is in the output so far, brought up to
  date each step with the tokens emitted since the last one.

So a step costs O(new tokens) on the host and one gather of the penalised rows on the
device, never O(history): the rows' penalties are then a few batched tensor ops
(`controls.py`). Drafts are never counted here: a draft row adds the drafts before it to
its gathered copy, so a rejected draft leaves nothing to undo. A preempted request keeps
its output tokens (recompute re-runs them as input), so its counts stand as they are.

What must stay true: a row's counts are those of `state.output_token_ids`. That list is
only appended to by the sampler; should it be replaced or cut (a rollback by its owner),
the row is counted afresh from it. Row 0 is all zeros and never written: the rows of a
step without penalties point at it. A request's row is freed when its SamplerState is
collected (no step can still read it then) and zeroed when handed out again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from vlmserve.sample.params import SamplerState

_INITIAL_ROWS = 16


class PenaltySlot:
    """A request's row of a table (on `SamplerState.penalties`), and how much of its
    output list the row has counted."""

    __slots__ = ("__weakref__", "index", "num_counted", "source", "table")

    def __init__(self, table: PenaltyTable, index: int) -> None:
        self.table, self.index = table, index
        self.source: list[int] | None = None  # the output list counted (its identity)
        self.num_counted = 0


class PenaltyTable:
    """Penalty rows for every request sampled on one device with one vocabulary size."""

    def __init__(self, vocab: int, device: torch.device, num_rows: int = _INITIAL_ROWS) -> None:
        self.vocab, self.device = vocab, device
        self.prompt = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(num_rows, vocab, dtype=torch.int32, device=device)
        self._free = list(range(num_rows - 1, 0, -1))  # row 0 stays zero
        # Rows of collected states. A finalizer may run on any thread, inside a step too:
        # it only appends (atomic), the sampling thread takes them under `lock`.
        self._released: list[int] = []
        self.lock = threading.RLock()  # held by a step from sync to gather

    @property
    def num_rows(self) -> int:
        return self.counts.shape[0]

    def sync(self, states: Sequence[SamplerState]) -> list[int]:
        """Each state's row with its counts brought up to date; hold `lock` from here to the
        `gather`. O(prompt) once per request, then O(tokens emitted since the last call)."""
        while self._released:
            self._free.append(self._released.pop())
        fresh: list[int] = []  # rows to zero: new ones (prompt too), recounted ones
        prompt_parts: list[tuple[int, tuple[int, ...]]] = []
        count_rows: list[int] = []
        count_ids: list[int] = []
        indices = []
        for state in states:
            slot = state.penalties
            if not isinstance(slot, PenaltySlot) or slot.table is not self:
                slot = state.penalties = self._allocate()
                prompt_parts.append((slot.index, state.prompt_token_ids))
            out = state.output_token_ids
            if slot.source is not out or len(out) < slot.num_counted:
                fresh.append(slot.index)  # new, or its list was replaced or cut
                slot.source, slot.num_counted = out, 0
            new = out[slot.num_counted :]
            slot.num_counted = len(out)
            count_rows += [slot.index] * len(new)
            count_ids += new
            indices.append(slot.index)
        self._write(fresh, prompt_parts, count_rows, count_ids)
        return indices

    def gather(self, indices: list[int], with_prompt: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts [len(indices), vocab] int32, prompt mask bool or an empty tensor): copies
        the caller may change."""
        index = torch.tensor(indices, dtype=torch.long).to(self.device, non_blocking=True)
        counts = self.counts.index_select(0, index)
        prompt = self.prompt.index_select(0, index) if with_prompt else self.prompt[:0]
        return counts, prompt

    def _allocate(self) -> PenaltySlot:
        if not self._free:
            self._grow()
        slot = PenaltySlot(self, self._free.pop())
        weakref.finalize(slot, self._released.append, slot.index)
        return slot

    def _grow(self) -> None:
        """Twice the rows (the old ones copied): a table is as large as the most penalised
        requests alive at once."""
        old = self.num_rows
        self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self._free += range(2 * old - 1, old - 1, -1)

    def _write(
        self,
        fresh: list[int],
        prompt_parts: list[tuple[int, tuple[int, ...]]],
        count_rows: list[int],
        count_ids: list[int],
    ) -> None:
        """Zero the fresh rows, mark the new prompts, add the new output tokens: a few ops
        for the whole step. Ids outside the vocabulary are left out."""
        device = self.device
        if fresh:
            rows = torch.tensor(fresh, dtype=torch.long).to(device, non_blocking=True)
            self.counts.index_fill_(0, rows, 0)
        if prompt_parts:
            rows = torch.tensor([r for r, _ in prompt_parts], dtype=torch.long).to(device)
            self.prompt.index_fill_(0, rows, False)
            ids = [torch.tensor(ids, dtype=torch.long) for _, ids in prompt_parts]
            owners = [torch.full_like(t, r) for (r, _), t in zip(prompt_parts, ids, strict=True)]
            pairs = torch.stack([torch.cat(owners), torch.cat(ids)], 1)
            self._put(self.prompt, pairs, accumulate=False)
        if count_ids:
            pairs = torch.tensor([count_rows, count_ids], dtype=torch.long).T
            self._put(self.counts, pairs, accumulate=True)

    def _put(self, target: torch.Tensor, pairs: torch.Tensor, accumulate: bool) -> None:
        """target[row, id] = True (or += 1) for each (row, id) of `pairs` [n, 2] (host)."""
        pairs = pairs[(pairs[:, 1] >= 0) & (pairs[:, 1] < self.vocab)].to(self.device)
        ones = torch.ones(pairs.shape[0], dtype=target.dtype, device=self.device)
        target.index_put_((pairs[:, 0], pairs[:, 1]), ones, accumulate=accumulate)


_TABLES: dict[tuple[str, int], PenaltyTable] = {}
_TABLES_LOCK = threading.Lock()


def table_for(device: torch.device, vocab: int) -> PenaltyTable:
    """The process's table for `device` and `vocab` (engines on one device share it: each
    request has a row of its own)."""
    key = (str(device), vocab)
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is None:
            table = _TABLES[key] = PenaltyTable(vocab, device)
        return table

"""The penalties' per-request state, kept incrementally where the logits are (vLLM's
`PenaltiesState` in its v2 model runner): one row per request of two tensors,

- `counts` [rows, vocab] float32 (whole numbers, exact to 2^24): how often each id is in
  the output so far, brought up to date each step with the tokens emitted since the last;
- `scale` [rows, vocab] float32: the request's repetition penalty r where its prompt or
  output holds the id, else 1.0 (the prompt's ids set once, at its first penalised step;
  each new output token's as it comes). vLLM keeps a prompt mask and combines it with the
  counts each step; the factor itself costs the step nothing (r is fixed per request).

So a step costs O(new tokens) on the host and one gather of the penalised rows on the
device, never O(history): the rows' penalties are then a few batched tensor ops
(`controls.py`). Drafts are never written here: a draft row adds the drafts before it to
its gathered copy, so a rejected draft leaves nothing to undo. A preempted request keeps
its output tokens (recompute re-runs them as input), so its counts stand as they are.

What must stay true: a row holds `state.output_token_ids` and the prompt. That list is
only appended to by the sampler; should it be replaced or cut (a rollback by its owner),
the row is made afresh from it. Row 0 (counts 0, scale 1) is never written: the rows of a
step without penalties point at it. A request's row is freed when its SamplerState is
collected (no step can still read it then) and reset when handed out again.
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
    output list the row holds."""

    __slots__ = ("__weakref__", "index", "num_counted", "rep", "source", "table")

    def __init__(self, table: PenaltyTable, index: int, rep: float) -> None:
        self.table, self.index, self.rep = table, index, rep
        self.source: list[int] | None = None  # the output list counted (its identity)
        self.num_counted = 0


class _Writes:
    """A step's writes to the table, made in a few ops: rows to reset, (row, id) pairs."""

    def __init__(self) -> None:
        self.fresh: list[int] = []
        self.count_rows: list[int] = []
        self.count_ids: list[int] = []
        # scale[row, id] = r: per output token (lists), per new prompt (row, ids, r)
        self.scale_rows: list[int] = []
        self.scale_ids: list[int] = []
        self.scale_values: list[float] = []
        self.prompts: list[tuple[int, torch.Tensor, float]] = []


class PenaltyTable:
    """Penalty rows for every request sampled on one device with one vocabulary size."""

    def __init__(self, vocab: int, device: torch.device, num_rows: int = _INITIAL_ROWS) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
        self.scale = torch.ones(num_rows, vocab, dtype=torch.float32, device=device)
        self._free = list(range(num_rows - 1, 0, -1))  # row 0 stays neutral
        # Rows of collected states. A finalizer may run on any thread, inside a step too:
        # it only appends (atomic), the sampling thread takes them under `lock`.
        self._released: list[int] = []
        self.lock = threading.RLock()  # held by a step from sync to gather

    @property
    def num_rows(self) -> int:
        return self.counts.shape[0]

    def sync(self, states: Sequence[SamplerState]) -> list[int]:
        """Each state's row brought up to date; hold `lock` from here to the `gather`.
        O(prompt) once per request, then O(tokens emitted since the last call)."""
        while self._released:
            self._free.append(self._released.pop())
        writes, indices = _Writes(), []
        for state in states:
            slot = state.penalties
            if not isinstance(slot, PenaltySlot) or slot.table is not self:
                slot = state.penalties = self._allocate(state.params.repetition_penalty)
            out = state.output_token_ids
            if slot.source is not out or len(out) < slot.num_counted:
                # New, or its list was replaced or cut: made afresh.
                writes.fresh.append(slot.index)
                if slot.rep != 1.0:
                    ids = torch.tensor(state.prompt_token_ids, dtype=torch.long)
                    writes.prompts.append((slot.index, ids, slot.rep))
                slot.source, slot.num_counted = out, 0
            new = out[slot.num_counted :]
            slot.num_counted = len(out)
            writes.count_rows += [slot.index] * len(new)
            writes.count_ids += new
            if new and slot.rep != 1.0:
                writes.scale_rows += [slot.index] * len(new)
                writes.scale_ids += new
                writes.scale_values += [slot.rep] * len(new)
            indices.append(slot.index)
        self._write(writes)
        return indices

    def gather(self, indices: list[int], with_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts [len(indices), vocab], scale or an empty tensor), float32 copies the
        caller may change."""
        index = torch.tensor(indices, dtype=torch.long).to(self.device, non_blocking=True)
        counts = self.counts.index_select(0, index)
        scale = self.scale.index_select(0, index) if with_scale else self.scale[:0]
        return counts, scale

    def _allocate(self, rep: float) -> PenaltySlot:
        if not self._free:
            self._grow()
        slot = PenaltySlot(self, self._free.pop(), rep)
        weakref.finalize(slot, self._released.append, slot.index)
        return slot

    def _grow(self) -> None:
        """Twice the rows (the old ones copied): a table is as large as the most penalised
        requests alive at once."""
        old = self.num_rows
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.scale = torch.cat([self.scale, torch.ones_like(self.scale)])
        self._free += range(2 * old - 1, old - 1, -1)

    def _write(self, writes: _Writes) -> None:
        """Reset the fresh rows, add the new output tokens, set r where ids were seen: a
        few ops for the whole step. Ids outside the vocabulary are left out."""
        if writes.fresh:
            rows = torch.tensor(writes.fresh, dtype=torch.long).to(self.device)
            self.counts.index_fill_(0, rows, 0.0)
            self.scale.index_fill_(0, rows, 1.0)
        if writes.count_ids:
            rows, ids = torch.tensor(writes.count_rows), torch.tensor(writes.count_ids)
            self._put(self.counts, rows, ids, torch.ones(len(ids)), accumulate=True)
        rows = [torch.tensor(writes.scale_rows, dtype=torch.long)]
        ids = [torch.tensor(writes.scale_ids, dtype=torch.long)]
        values = [torch.tensor(writes.scale_values, dtype=torch.float32)]
        for row, prompt, rep in writes.prompts:
            rows.append(torch.full_like(prompt, row))
            ids.append(prompt)
            values.append(torch.full(prompt.shape, rep))
        if writes.scale_ids or writes.prompts:
            self._put(self.scale, torch.cat(rows), torch.cat(ids), torch.cat(values), False)

    def _put(
        self,
        target: torch.Tensor,
        rows: torch.Tensor,
        ids: torch.Tensor,
        values: torch.Tensor,
        accumulate: bool,
    ) -> None:
        """target[rows[i], ids[i]] = (or +=) values[i], host tensors; ids outside the
        vocabulary left out."""
        keep = (ids >= 0) & (ids < self.vocab)
        index = (rows[keep].to(self.device), ids[keep].to(self.device))
        target.index_put_(index, values[keep].to(self.device, target.dtype), accumulate)


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

"""Sampling every row of a step at once, where the logits are.

On the host: each sampling row's parameters and two uniforms from its request's own
generator, packed into one float64 tensor (one host-to-device copy, non-blocking). On
the device: `sampling_ops` over [rows, vocab] for all sampling rows together, and one
argmax over the greedy rows. Back: token ids and per-row flags in one device-to-host copy.

A request draws 2 uniforms per row it owns whatever else is in the batch, so a seeded
request's tokens are the same alone and in any batch (up to the last-ulp differences
vectorised float math may have between row positions: a token changes only if its
uniform falls within such a difference of a boundary, about 1e-7 of the time at most).
Rows are independent, so on the CPU, where a sync costs nothing, drafts are verified
position by position and rows past a request's first rejection are skipped: the tokens
are the same as drawing every row, with less work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kernels import sampling_cpu
from vlmserve.sample.controls import apply_controls
from vlmserve.sample.ops import (
    draw,
    filter_min_p_,
    filter_top_k_top_p_,
    num_top_candidates,
    temperature_weights,
)
from vlmserve.sample.params import SamplerState

FLOAT32_MAX = torch.finfo(torch.float32).max
# On the CPU a batch of sampling rows holds at most this many bytes of float32 weights
# (`rows_per_batch`): 8 rows at a 262,144-token vocabulary, 65 at 32,000.
BATCH_BYTES = 8 << 20


class RowGroup(NamedTuple):
    """One sampling item's rows of logits: one per draft token, then the bonus row."""

    state: SamplerState
    first_row: int
    draft_token_ids: tuple[int, ...] = ()


class GroupResult(NamedTuple):
    """What a group's rows drew. Greedy: every row's argmax, no flags. Sampling: the rows
    up to the first rejected draft (or all of them), each row's token drawn from p, or
    from p without the row's draft when it has one, and per draft reached whether it was
    accepted. error: why the group could not be sampled (None when it was)."""

    token_ids: list[int]
    accepted: list[bool]
    error: str | None = None


@dataclass
class _Draws:
    """One sampling group while its rows are drawn (host side)."""

    group: RowGroup
    uniforms: list[float]  # accept then sample, 2 per row, drawn before anything runs
    tokens: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    error: str | None = None
    done: bool = False

    @property
    def num_rows(self) -> int:
        return 1 + len(self.group.draft_token_ids)

    def take(self, token: int, accepted: bool, failed: bool) -> None:
        """The next row's result; after a rejection (or the bonus row) the rest is unused."""
        if self.done:
            return
        position = len(self.tokens)
        self.tokens.append(token)
        if failed:
            self.error, self.done = "logits are not finite", True
        elif position < len(self.group.draft_token_ids):
            self.accepted.append(accepted)
            self.done = not accepted
        else:
            self.done = True


@dataclass
class _Batch:
    """Sampling rows to draw together: per row its logits row and parameters."""

    rows: list[int] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    u_accept: list[float] = field(default_factory=list)
    u_sample: list[float] = field(default_factory=list)
    filter_rows: list[int] = field(default_factory=list)  # rows with top-k or top-p
    top_k: list[int] = field(default_factory=list)  # per filter row, 0: off
    top_p: list[float] = field(default_factory=list)  # per filter row, 1: off
    min_p: list[float] = field(default_factory=list)  # per row, 0: off
    draft_rows: list[int] = field(default_factory=list)  # rows with a draft
    draft_ids: list[int] = field(default_factory=list)
    owners: list[_Draws] = field(default_factory=list)  # per row

    def add(self, draws: _Draws, position: int, vocab: int) -> None:
        group, params = draws.group, draws.group.state.params
        index = len(self.rows)
        top_k = params.top_k if params.top_k < vocab else 0
        if top_k or params.top_p < 1.0:
            self.filter_rows.append(index)
            self.top_k.append(top_k)
            self.top_p.append(params.top_p)
        if position < len(group.draft_token_ids):
            self.draft_rows.append(index)
            self.draft_ids.append(group.draft_token_ids[position])
        self.rows.append(group.first_row + position)
        # A huge temperature would be inf in float32, and -inf / inf is NaN.
        self.temperature.append(min(params.temperature, FLOAT32_MAX))
        self.min_p.append(params.min_p)
        self.u_accept.append(draws.uniforms[position])
        self.u_sample.append(draws.uniforms[draws.num_rows + position])
        self.owners.append(draws)

    def to_device(self, device: torch.device, greedy_rows: list[int]) -> dict[str, torch.Tensor]:
        """Every list (and the greedy rows) as a tensor on `device`, through one float64
        copy: ids and counts are exact in float64."""
        lists = {
            "rows": self.rows, "temperature": self.temperature, "u_accept": self.u_accept,
            "u_sample": self.u_sample, "filter_rows": self.filter_rows, "top_k": self.top_k,
            "top_p": self.top_p, "min_p": self.min_p, "draft_rows": self.draft_rows,
            "draft_ids": self.draft_ids,
            "greedy_rows": greedy_rows,
        }  # fmt: skip
        flat = torch.tensor([x for v in lists.values() for x in v], dtype=torch.float64)
        parts = flat.to(device, non_blocking=True).split([len(v) for v in lists.values()])
        out = dict(zip(lists, parts, strict=True))
        for name in ("rows", "filter_rows", "top_k", "draft_rows", "draft_ids", "greedy_rows"):
            out[name] = out[name].long()
        out["temperature"], out["top_p"] = out["temperature"].float(), out["top_p"].float()
        out["min_p"] = out["min_p"].float()
        return out

    def hand_out(self, flat: list[int]) -> None:
        """Give each row's (token, accepted, failed) from `flat` to its group."""
        num = len(self.rows)
        columns = (flat[:num], flat[num : 2 * num], flat[2 * num :])
        for owner, token, ok, failed in zip(self.owners, *columns, strict=True):
            owner.take(token, bool(ok), bool(failed))


def _draw_batch(
    logits: torch.Tensor, batch: _Batch, dev: dict[str, torch.Tensor]
) -> list[torch.Tensor]:
    """[tokens, accepted, failed] ([batch rows] long each) for a batch of sampling rows."""
    num_rows, vocab = logits.shape
    every = batch.rows == list(range(num_rows))
    weights, failed = temperature_weights(
        logits if every else logits.index_select(0, dev["rows"]), dev["temperature"]
    )
    if any(batch.min_p):  # vLLM's order: temperature, min_p, then top-k and top-p
        filter_min_p_(weights, dev["min_p"])
    if batch.filter_rows:
        top_p = any(p < 1.0 for p in batch.top_p)
        num = num_top_candidates(logits.device, vocab, batch.top_k, top_p)
        rows = None if len(batch.filter_rows) == len(batch.rows) else dev["filter_rows"]
        top_k = dev["top_k"] if any(batch.top_k) else None
        filter_top_k_top_p_(weights, rows, top_k, dev["top_p"] if top_p else None, num)
    tokens, accepted = draw(
        weights, dev["u_accept"], dev["u_sample"], dev["draft_rows"], dev["draft_ids"]
    )
    return [tokens, accepted.long(), failed.long()]


def _run(logits: torch.Tensor, batch: _Batch, greedy_rows: list[int]) -> list[int]:
    """The greedy rows' argmaxes, then the batch's tokens, accepted and failed flags:
    one copy in, one copy back."""
    if not batch.rows and not greedy_rows:
        return []
    dev = batch.to_device(logits.device, greedy_rows)
    parts = []
    if greedy_rows:
        every = greedy_rows == list(range(logits.shape[0]))
        rows = None if every else dev["greedy_rows"]
        parts.append(sampling_cpu.argmax_any(logits, rows))  # torch's, without its slow reduction
    if batch.rows:
        parts += _draw_batch(logits, batch, dev)
    return torch.cat(parts).tolist()


def _draw_all(
    logits: torch.Tensor, draws: list[_Draws], greedy_rows: list[int], progressive: bool
) -> list[int]:
    """Draw the sampling groups' rows (their results land in `draws`); returns the greedy
    rows' argmaxes. One batch of every row, or (progressive) one per draft position; on
    the CPU each in batches of at most `rows_per_batch` rows."""
    vocab = logits.shape[-1]
    depth = max((d.num_rows for d in draws), default=1) if progressive else 1
    most = rows_per_batch(logits.device, vocab)
    greedy_tokens: list[int] = []
    for position in range(depth):
        batches = [_Batch()]
        for d in draws:
            for p in [position] if progressive else range(d.num_rows):
                if not d.done and p < d.num_rows:
                    if len(batches[-1].rows) == most:
                        batches.append(_Batch())
                    batches[-1].add(d, p, vocab)
        for i, batch in enumerate(batches):
            first = position == 0 and i == 0
            flat = _run(logits, batch, greedy_rows if first else [])
            if first:
                greedy_tokens, flat = flat[: len(greedy_rows)], flat[len(greedy_rows) :]
            batch.hand_out(flat)
    return greedy_tokens


def rows_per_batch(device: torch.device, vocab: int) -> int | None:
    """The most sampling rows drawn in one batch: on the CPU so many that a [rows, vocab]
    float32 temporary stays under BATCH_BYTES (a step's rows at a 262k vocabulary would
    make each 64 MiB: fresh pages from the kernel every step, and out of every cache);
    None (no limit) on an accelerator, where each batch costs a host sync."""
    if device.type != "cpu":
        return None
    return max(1, BATCH_BYTES // (4 * vocab))


def sample_rows(
    logits: torch.Tensor, groups: Sequence[RowGroup], by_position: bool | None = None
) -> list[GroupResult]:
    """Draw every group's rows of `logits` ([num_rows, vocab], any device, any float dtype);
    one result per group, in order. by_position: a batch per draft position, skipping rows
    after a rejection (None: on the CPU); the results are the same either way. The
    groups' logit controls (penalties, bias, ...) apply first, to a copy."""
    logits = apply_controls(logits, groups)
    vocab = logits.shape[-1]
    greedy_rows: list[int] = []
    draws: dict[int, _Draws] = {}
    for i, group in enumerate(groups):
        num = 1 + len(group.draft_token_ids)
        if group.state.params.greedy:
            greedy_rows += range(group.first_row, group.first_row + num)
            continue
        try:
            uniforms = group.state.uniforms(2 * num)  # whatever the batch
        except Exception as e:  # noqa: BLE001 - this request's generator alone
            draws[i] = _Draws(group, [0.0] * (2 * num))
            draws[i].error, draws[i].done = f"its generator failed: {e!r}", True
            continue
        draws[i] = _Draws(group, uniforms)
        if not all(0 <= t < vocab for t in group.draft_token_ids):  # never a bad index
            draws[i].error = f"a draft token id is outside the vocabulary of {vocab}"
            draws[i].done = True
    if by_position is None:
        by_position = logits.device.type == "cpu"
    greedy = iter(_draw_all(logits, list(draws.values()), greedy_rows, by_position))
    return [
        GroupResult(draws[i].tokens, draws[i].accepted, draws[i].error)
        if i in draws
        else GroupResult([next(greedy) for _ in range(1 + len(group.draft_token_ids))], [])
        for i, group in enumerate(groups)
    ]


def sample(logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
    """One token per row, row i with states[i]. logits: [len(states), vocab], any device.
    Raises ValueError naming a row whose logits are not finite."""
    results = sample_rows(logits, [RowGroup(state, i) for i, state in enumerate(states)])
    for i, result in enumerate(results):
        if result.error is not None:
            raise ValueError(f"row {i}: {result.error}")
    return [result.token_ids[0] for result in results]

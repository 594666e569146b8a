"""Logit controls, every controlled row of a step at once: bad words, min_tokens,
logit_bias, then the repetition / frequency / presence penalties, in vLLM v1's order and
with its definitions (`v1/sample/sampler.py`, `ops/penalties.py`):

- bad_words: a one-token word is banned always; a longer one bans its last token when the
  output ends with the rest (matched on output tokens, as vLLM);
- min_tokens: the stop ids (its own and the model's EOS, unless ignore_eos) are banned
  while fewer than min_tokens tokens are out;
- logit_bias: added to the logit;
- repetition_penalty r, over prompt and output tokens: a positive logit is divided by r,
  a negative one multiplied by r;
- frequency f and presence p, over output tokens: logit -= f * count + p * (count > 0).

Row j of a group with drafts sees the drafts before it as output (the tokens it would
follow). The result is a new float32 tensor: the caller's logits stay raw, since logprobs
are computed from them. min_p is a filter on the weights (`ops.filter_min_p_`), not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vlmserve.sample.params import SamplerState


@dataclass
class _Rows:
    """Host lists for the controlled rows, flattened (one tensor each)."""

    rows: list[int] = field(default_factory=list)  # logits row per controlled row
    rep: list[float] = field(default_factory=list)
    freq: list[float] = field(default_factory=list)
    pres: list[float] = field(default_factory=list)
    banned: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    bias: tuple[list[int], list[int], list[float]] = field(default_factory=lambda: ([], [], []))
    # Per penalised row: its output tokens, and (repetition) the prompt's distinct ids as
    # a host tensor made once per request: no per-step Python over a long prompt.
    output: list[tuple[int, list[int]]] = field(default_factory=list)
    prompt: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, state: SamplerState, row: int, history: list[int], vocab: int) -> None:
        params, index = state.params, len(self.rows)
        self.rows.append(row)
        self.rep.append(params.repetition_penalty)
        self.freq.append(params.frequency_penalty)
        self.pres.append(params.presence_penalty)
        banned = set(banned_words(state.bad_words_ids, history))
        if len(history) < params.min_tokens:
            banned.update(state.stop_token_ids)
        for token in sorted(t for t in banned if 0 <= t < vocab):
            self.banned[0].append(index)
            self.banned[1].append(token)
        for token, value in params.logit_bias:
            if token < vocab:  # checked against the vocabulary at admission
                self.bias[0].append(index)
                self.bias[1].append(token)
                self.bias[2].append(value)
        if params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1:
            self.output.append((index, [t for t in history if 0 <= t < vocab]))
        if params.repetition_penalty != 1.0:
            if state.prompt_unique_ids is None:  # once per request, not per step
                ids = sorted(t for t in set(state.prompt_token_ids) if 0 <= t < vocab)
                state.prompt_unique_ids = torch.tensor(ids, dtype=torch.long)
            self.prompt.append((index, state.prompt_unique_ids))


def banned_words(bad_words_ids: Sequence[Sequence[int]], history: Sequence[int]) -> list[int]:
    """The last token of each bad word whose other tokens end `history`."""
    out = []
    for word in bad_words_ids:
        prefix = list(word[:-1])
        if not prefix or list(history[len(history) - len(prefix) :]) == prefix:
            out.append(word[-1])
    return out


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def _pairs(parts: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors from per-row id lists or host tensors."""
    ids = [
        p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.long) for _, p in parts
    ]
    rows = [
        torch.full((len(t),), i, dtype=torch.long) for (i, _), t in zip(parts, ids, strict=True)
    ]
    return torch.cat(rows).to(device, non_blocking=True), torch.cat(ids).to(
        device, non_blocking=True
    )


def _penalise(x: torch.Tensor, host: _Rows) -> None:
    """The three penalties in place on x [rows, vocab] float32. Repetition touches only
    the (row, token) pairs seen (a pair listed twice gets the same value twice)."""
    device = x.device
    out_rows, out_ids = _pairs(host.output, device)
    if any(r != 1.0 for r in host.rep):
        rows, ids = out_rows, out_ids
        if host.prompt:
            prompt_rows, prompt_ids = _pairs(host.prompt, device)
            rows, ids = torch.cat([rows, prompt_rows]), torch.cat([ids, prompt_ids])
        rep = _float(host.rep, device)[rows]
        flat = rows * x.shape[1] + ids  # x is contiguous: 1-D indexing is the cheap kind
        values = x.view(-1)[flat]
        x.view(-1)[flat] = torch.where(values > 0, values / rep, values * rep)
    if any(host.freq) or any(host.pres):
        counts = torch.zeros_like(x)
        counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=x.dtype),
                          accumulate=True)  # fmt: skip
        if any(host.freq):
            x.sub_(_float(host.freq, device)[:, None] * counts)
        if any(host.pres):
            x.sub_(_float(host.pres, device)[:, None] * (counts > 0))


def apply_controls(logits: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """`logits` ([rows, vocab]) with every group's controls applied to its rows: the
    same tensor when no group has any, else a new float32 one. groups: `RowGroup`s
    (state, first_row, draft_token_ids)."""
    vocab = logits.shape[-1]
    host = _Rows()
    for group in groups:
        state = group.state
        if not state.params.has_logit_controls:
            continue
        history = list(state.output_token_ids)
        for j in range(1 + len(group.draft_token_ids)):
            host.add(state, group.first_row + j, history + list(group.draft_token_ids[:j]), vocab)
    if not host.rows:
        return logits
    device = logits.device
    out = logits.float().clone()
    rows = _long(host.rows, device)
    x = out.index_select(0, rows)  # [controlled rows, vocab]
    if host.banned[0]:
        x[_long(host.banned[0], device), _long(host.banned[1], device)] = float("-inf")
    if host.bias[0]:
        index = (_long(host.bias[0], device), _long(host.bias[1], device))
        x.index_put_(index, _float(host.bias[2], device), accumulate=True)
    if host.output or host.prompt:
        _penalise(x, host)
    out.index_copy_(0, rows, x)
    return out

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
    output: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    prompt: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))

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
            kept = [t for t in history if 0 <= t < vocab]
            self.output[0].extend([index] * len(kept))
            self.output[1].extend(kept)
        if params.repetition_penalty != 1.0:
            if state.prompt_unique_ids is None:  # once per request, not per step
                state.prompt_unique_ids = sorted(set(state.prompt_token_ids))
            kept = [t for t in state.prompt_unique_ids if 0 <= t < vocab]
            self.prompt[0].extend([index] * len(kept))
            self.prompt[1].extend(kept)


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


def _penalise(x: torch.Tensor, host: _Rows) -> None:
    """The three penalties in place on x [rows, vocab] float32."""
    device, shape = x.device, x.shape
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    if host.output[0]:
        index = (_long(host.output[0], device), _long(host.output[1], device))
        counts.index_put_(index, torch.ones(len(host.output[0]), device=device), accumulate=True)
    seen = counts > 0
    if any(r != 1.0 for r in host.rep):
        seen_any = seen.clone()
        if host.prompt[0]:
            seen_any[_long(host.prompt[0], device), _long(host.prompt[1], device)] = True
        rep = _float(host.rep, device)[:, None].expand(shape)
        penalised = torch.where(x > 0, x / rep, x * rep)
        x.copy_(torch.where(seen_any, penalised, x))
    if any(host.freq):
        x.sub_(_float(host.freq, device)[:, None] * counts)
    if any(host.pres):
        x.sub_(_float(host.pres, device)[:, None] * seen)


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
    if host.output[0] or host.prompt[0]:
        _penalise(x, host)
    out.index_copy_(0, rows, x)
    return out

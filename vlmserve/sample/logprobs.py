"""Logprobs of emitted tokens (and of prompt tokens), every wanted row of a step at once.

Raw logprobs, as vLLM's default `logprobs_mode="raw_logprobs"`: log_softmax over the
model's logits in float32, before logit controls, temperature and the top-k / top-p /
min_p filters. So a token's logprob does not depend on how it was sampled, and scoring
(lm-eval's loglikelihood) sees the model's own distribution. A row also gives the
token's rank in that distribution (1: the most likely) and its `k` most likely tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens strictly more likely
    top: tuple[tuple[int, float], ...]  # the k most likely (id, logprob), best first


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """For each i: the logprob and rank of token_ids[i] under logits[rows[i]] ([rows, vocab],
    any float dtype, any device) and its num_top[i] most likely tokens. One batch: a
    log_softmax over the wanted rows and one copy back."""
    if not rows:
        return []
    device = logits.device
    index = torch.tensor(list(rows), dtype=torch.long).to(device, non_blocking=True)
    tokens = torch.tensor(list(token_ids), dtype=torch.long).to(device, non_blocking=True)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [wanted, vocab]
    chosen = lp.gather(1, tokens[:, None])  # [wanted, 1]
    rank = (lp > chosen).sum(-1) + 1
    k = min(max(num_top), lp.shape[-1])
    parts = [chosen.squeeze(1).double(), rank.double()]
    if k:
        top = lp.topk(k, dim=-1)
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    flat = torch.cat(parts).tolist()  # ids are exact in float64
    n = len(rows)
    values, ids = flat[2 * n : 2 * n + n * k], flat[2 * n + n * k :]
    out = []
    for i in range(n):
        span = slice(i * k, i * k + num_top[i])
        pairs = zip(ids[span], values[span], strict=True)
        top_i = tuple((int(t), v) for t, v in pairs)
        out.append(TokenLogprob(int(token_ids[i]), flat[i], int(flat[n + i]), top_i))
    return out


def book_emitted(logits: torch.Tensor, groups: Sequence, emitted: Sequence) -> None:
    """After a step's sampling: each group's state records its emitted tokens (the logit
    controls read them) and, when its request wants logprobs, one entry with a
    TokenLogprob per emitted token (row first_row + j emitted token j). groups: `RowGroup`s;
    emitted: per group, its tokens or the exception its sampling raised."""
    rows, tokens, num_top, owners = [], [], [], []
    for group, out in zip(groups, emitted, strict=True):
        if isinstance(out, Exception):
            continue
        state = group.state
        state.output_token_ids.extend(out)
        if state.params.logprobs is None:
            continue
        owners.append((state, len(out)))
        rows += range(group.first_row, group.first_row + len(out))
        tokens += out
        num_top += [state.params.logprobs] * len(out)
    records = iter(token_logprobs(logits, rows, tokens, num_top))
    for state, count in owners:
        state.logprobs.append([next(records) for _ in range(count)])


def prompt_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], first: int, num_top: int
) -> list[TokenLogprob]:
    """Logprobs of prompt tokens first+1 .. first+len(logits): row i of `logits` is the
    distribution after prompt position first + i, so it scores token first + i + 1."""
    num = min(logits.shape[0], len(token_ids) - first - 1)
    if num <= 0:
        return []
    targets = token_ids[first + 1 : first + 1 + num]
    return token_logprobs(logits, range(num), targets, [num_top] * num)

"""Logprobs of emitted tokens (and of prompt tokens), every wanted row of a step at once.

Raw logprobs, as vLLM's default `logprobs_mode="raw_logprobs"`: log_softmax over the
model's logits in float32, before logit controls, temperature and the top-k / top-p /
min_p filters. So a token's logprob does not depend on how it was sampled, and scoring
(lm-eval's loglikelihood) sees the model's own distribution. A row also gives the
token's rank in that distribution (1: the most likely) and its `k` most likely tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def book_prompt_logprobs(
    logits: torch.Tensor, spans: Sequence[tuple[str, int, int]], states: Mapping
) -> None:
    """Prompt logprobs of a step: its last rows (after the sampling rows) are, per span
    (request id, first position p, count), the distributions after prompt positions p ..
    p + count - 1, each scoring the prompt token after it. Each state gets one entry
    (first scored position, records) in its `prompt_logprobs` deque."""
    num = sum(count for _, _, count in spans)
    row = logits.shape[0] - num
    rows, tokens, num_top, owners = [], [], [], []
    for request_id, first, count in spans:
        state = states[request_id]
        owners.append((state, first + 1, count))
        rows += range(row, row + count)
        tokens += state.prompt_token_ids[first + 1 : first + 1 + count]
        num_top += [state.params.prompt_logprobs or 0] * count
        row += count
    records = iter(token_logprobs(logits, rows, tokens, num_top))
    for state, position, count in owners:
        state.prompt_logprobs.append((position, [next(records) for _ in range(count)]))

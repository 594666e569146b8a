"""Verifying n-gram drafts losslessly (article §15).

A speculating sequence's γ drafts come back with γ+1 rows of logits: row i is the
target's distribution for the token after draft i-1 (row 0: after the last real token).
- greedy: accept the longest prefix where draft == argmax, then emit the argmax at the
  first mismatch, or the bonus argmax of row γ when every draft held. The output is
  exactly that of plain greedy decoding.
- sampling: the draft is deterministic (q = a point mass on d), so the rejection rule
  accept-with-min(1, p/q) becomes: accept d with probability p(d); on rejection sample
  from max(0, p - q) normalised, which is p with d removed and renormalised. Each token
  is then distributed exactly as plain sampling from p (Leviathan et al., Chen et al.).
p is the request's filtered distribution (temperature, top-k, top-p) and the draws use
its own seeded generator, so a request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from scheduler.planner import ScheduledSeq
from search.cost_model import b_star
from search.presets import Precision, get_accelerator, measure_cpu
from vlmserve.sampling import SamplerState, filtered_probs, sample


def verify_greedy(targets: list[int], drafts: tuple[int, ...]) -> list[int]:
    """The longest prefix of `drafts` that matches the argmaxes `targets` (one per row,
    len(drafts) + 1), then the argmax at the first mismatch (or the bonus one)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return [*drafts[:accepted], targets[accepted]]


def verify(logits: torch.Tensor, drafts: tuple[int, ...], state: SamplerState) -> list[int]:
    """The accepted drafts and one more token. logits: [len(drafts) + 1, vocab] float32."""
    params = state.params
    if params.greedy:
        return verify_greedy(logits.argmax(-1).tolist(), drafts)
    tokens: list[int] = []
    for row, draft in zip(logits, drafts, strict=False):
        probs = filtered_probs(row, params)
        if float(torch.rand((), generator=state.generator)) < float(probs[draft]):
            tokens.append(draft)
            continue
        probs[draft] = 0.0  # rejected: p without the draft token, renormalised
        tokens.append(int(torch.multinomial(probs / probs.sum(), 1, generator=state.generator)))
        return tokens
    return [*tokens, *sample(logits[-1:], [state])]  # every draft held: the bonus token


def sample_plan(
    scheduled: list[ScheduledSeq], logits: torch.Tensor, samplers: list[SamplerState]
) -> list[list[int] | Exception]:
    """The tokens each scheduled item emits ([] for a prefill chunk that does not sample),
    or the exception its sampling raised: that fails the request alone, and the others
    keep the tokens (and generator states) they would have had anyway.
    logits: [num_sampling_rows, vocab] as the runner returns them; `samplers` has one
    state per sampling item, in plan order."""
    # Greedy rows never come to the host as logits: one argmax over every row where the
    # logits are, and only token ids come back; the rows of sampling requests move alone.
    spans: list[tuple[SamplerState, tuple[int, ...], int]] = []  # per sampling item
    row, states = 0, iter(samplers)
    for item in scheduled:
        if item.sample:
            spans.append((next(states), item.draft_token_ids, row))
            row += 1 + len(item.draft_token_ids)
    targets = logits.argmax(-1).tolist() if any(s.params.greedy for s, _, _ in spans) else []
    moved = [
        r for s, d, first in spans if not s.params.greedy for r in range(first, first + 1 + len(d))
    ]
    host: dict[int, int] = {r: i for i, r in enumerate(moved)}  # row -> row of `on_host`
    on_host = logits[moved].float().cpu() if moved else logits.new_empty(0)
    sampled: list[list[int] | Exception] = []
    taken = iter(spans)
    for item in scheduled:
        if not item.sample:
            sampled.append([])
            continue
        state, drafts, first = next(taken)
        try:
            if state.params.greedy:
                sampled.append(verify_greedy(targets[first : first + 1 + len(drafts)], drafts))
                continue
            rows = on_host[host[first] : host[first] + 1 + len(drafts)]
            sampled.append(verify(rows, drafts, state) if drafts else sample(rows, [state]))
        except Exception as e:  # noqa: BLE001 - reported as this request's failure
            sampled.append(e)
    return sampled


_PRESET_KEYS = ("h200", "h100", "b200", "a100", "l40s")


def ridge_batch_for(device: torch.device, dtype: torch.dtype) -> float:
    """B* = s_w·π/(2β) (article §11) for the engine's device and weight dtype: a datasheet
    preset for a known GPU (the H100 one otherwise), this machine measured for a CPU."""
    weight = Precision(str(dtype), torch.finfo(dtype).bits / 8, "bf16")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        key = next((k for k in _PRESET_KEYS if k in name), "h100")
        return b_star(get_accelerator(key), weight)
    return b_star(measure_cpu(), weight)

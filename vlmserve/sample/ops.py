"""Sampling ops over [rows, vocab]: every sampling row of a step at once, on the device
the logits are on, with per-row parameter tensors (vLLM v1's sampler is the model).

A row's distribution is kept as weights, not probabilities: w = exp((logits - max) / T).
The max becomes exp(0) = 1, so nothing overflows and a tiny T leaves a point mass on the
argmax, never NaN. Top-k and top-p then zero the weights below a per-row cutoff; the
cutoffs compare weights, so a token tied with the cutoff stays (as top-k does in
`filtered_probs`; for top-p the reference drops the tied tokens after its sort, in an
arbitrary order, and this keeps them). A token is drawn by inverse CDF from one uniform per
row, which the caller draws from the row's own generator, so a row's token does not
depend on the other rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import sampling_cpu

# Inverse-CDF blocks: float32 sums never run over more than this many columns, and the
# running sums across blocks and inside the chosen block are float64.
BLOCK_SIZE = 256
# Top-p on the CPU looks at this many candidates first (a topk) and widens only the rows
# whose nucleus is larger: a full sort of 32000 columns costs ~20x a topk of 128 there.
CPU_TOP_P_CANDIDATES = 128
# Each widening multiplies the candidates by this (on the CPU, where the kernel runs, the
# widened rows take at once as many as their nuclei need: `sampling_cpu.nucleus_sizes`).
WIDEN = 8


def temperature_weights(
    logits: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """exp((logits - max) / T) as a new [rows, vocab] float32 tensor (the logits stay
    untouched), and the rows whose logits are not finite ([rows] bool: a NaN or +inf
    somewhere, or nothing but -inf), whose weights mean nothing.
    temperature: [rows] float32, each at least GREEDY_TEMPERATURE."""
    logits = logits.float()
    top = logits.amax(-1, keepdim=True)  # [rows, 1]; NaN when the row holds one
    if sampling_cpu.can_run(logits):  # bitwise the same, without exp(-inf)'s slow path
        weights = sampling_cpu.temperature_weights(logits, top, temperature)
    else:
        weights = sampling_cpu.temperature_weights_eager(logits, top, temperature)
    return weights, ~torch.isfinite(top.squeeze(-1))


def filter_min_p_(weights: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero in place the weights under min_p times the row's largest: with the max at
    weight 1, p < min_p * p_max is w < min_p (vLLM's min_p, after temperature).
    min_p: [rows] float32 in [0, 1], 0 for off; the argmax always stays."""
    weights.masked_fill_(weights < min_p[:, None], 0.0)


def num_top_candidates(device: torch.device, vocab: int, top_ks: list[int], top_p: bool) -> int:
    """How many of each row's largest weights `filter_top_k_top_p_` starts from: every
    active top_k, and for top-p the CPU guess (it widens, which syncs) or, on an
    accelerator, the whole vocabulary (a sort: never widens, no host sync)."""
    wanted = max(top_ks, default=0)
    if top_p:
        wanted = max(wanted, CPU_TOP_P_CANDIDATES if device.type == "cpu" else vocab)
    return min(max(wanted, 1), vocab)


def filter_top_k_top_p_(
    weights: torch.Tensor,
    rows: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    num_candidates: int,
) -> None:
    """Zero in place the weights that top-k and then top-p remove, in `rows` of weights
    (None: every row). top_k: [len(rows)] long, 0 for off (also for k >= vocab), or None
    when no row has one; top_p: [len(rows)] float32, 1 for off, or None when no row has
    one; num_candidates >= every top_k. A row whose nucleus reaches past its candidates
    is redone with more (`_wider`). The result does not depend on num_candidates."""
    vocab = weights.shape[-1]
    num = min(num_candidates, vocab)
    while True:
        part = weights if rows is None else weights[rows]
        wider = _cut_(part, top_k, top_p, num)
        if rows is not None:
            weights[rows] = part
        if wider is None or not bool(wider.any()):  # the sync happens on the CPU path only
            return
        more = wider.nonzero().squeeze(-1)
        rows = more if rows is None else rows[more]
        assert top_p is not None, "only a top-p cut widens"
        top_k = None if top_k is None else top_k[more]
        top_p = top_p[more]
        num = min(vocab, _wider(weights, rows, top_p, num))


def _wider(weights: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor, num: int) -> int:
    """How many candidates the `rows` whose nuclei outgrew `num` take next: on the CPU (one
    pass of the kernel, bounding each nucleus from its weights' histogram) at once what
    they need; elsewhere WIDEN times as many (no host sync to size it)."""
    if sampling_cpu.can_run(weights):
        return max(num + 1, int(sampling_cpu.nucleus_sizes(weights, top_p, rows).max()))
    return WIDEN * num


def _cut_(
    weights: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, num: int
) -> torch.Tensor | None:
    """One pass of `filter_top_k_top_p_` over the `num` largest weights of each row. Returns
    the rows whose nucleus may reach past them (their top-p cut is left undone), or None
    when none can (no top-p, or the candidates are whole rows)."""
    vocab = weights.shape[-1]
    if num < vocab:
        top = weights.topk(num, -1).values  # [rows, num], descending
    else:
        top = weights.sort(-1, descending=True).values
    if top_k is not None:
        kth = top.gather(1, (top_k - 1).clamp(0, num - 1)[:, None])  # [rows, 1]
        kth.masked_fill_((top_k == 0)[:, None], 0.0)
        weights.masked_fill_(weights < kth, 0.0)
        top = top.masked_fill(top < kth, 0.0)
    if top_p is None:
        return None
    # top-p over what top-k left, as filtered_probs: a candidate stays while the mass of
    # the ones before it is under top_p; the first always stays (top_p may be 1e-300).
    probs = top / weights.sum(-1, keepdim=True)
    before = probs.cumsum(-1) - probs
    num_kept = (before < top_p[:, None]).sum(-1, keepdim=True).clamp_(min=1)  # [rows, 1]
    cutoff = top.gather(1, num_kept - 1)
    off = top_p >= 1.0
    wider = None
    if num < vocab:  # every candidate kept, and the row has weight past them
        wider = (num_kept.squeeze(-1) == num) & (top[:, -1] > 0) & ~off
        off = off | wider
    cutoff.masked_fill_(off[:, None], 0.0)
    weights.masked_fill_(weights < cutoff, 0.0)
    return wider


def remove_draft_(weights: torch.Tensor, rows: torch.Tensor, draft_ids: torch.Tensor) -> None:
    """Zero each draft's weight in its row: after a rejection the token comes from
    max(0, p - q) normalised, which for the point mass q on the draft is p without it."""
    weights[rows, draft_ids] = 0.0


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[rows] long: per row, the first column where the running sum of the weights passes
    u * their total, i.e. a draw from the normalised weights for u uniform in [0, 1).
    weights: [rows, vocab] float32 >= 0; u: [rows] float64. A column of weight 0 never
    comes out of a row with any weight, whatever u (0 and 1 - 2**-53 included)."""
    num_rows, vocab = weights.shape
    size = min(BLOCK_SIZE, vocab)
    pad = -vocab % size
    blocks = (F.pad(weights, (0, pad)) if pad else weights).view(num_rows, -1, size)
    ends = blocks.sum(-1).double().cumsum(-1)  # [rows, blocks]: running sum at block ends
    total = ends[:, -1:]
    zero = torch.zeros_like(total)
    # Strictly under the total, so the search lands on a block (and a column) with weight.
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, zero))  # [rows, 1]
    block = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[1] - 1)
    start = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), zero)
    chosen = blocks.gather(1, block[:, :, None].expand(-1, 1, size)).squeeze(1)  # [rows, size]
    inner = chosen.double().cumsum(-1)
    rest = torch.minimum(target - start, torch.nextafter(inner[:, -1:], zero))
    column = torch.searchsorted(inner, rest, right=True).clamp_(max=size - 1)
    return (block * size + column).squeeze(-1).clamp_(max=vocab - 1)


def draw(
    weights: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    draft_rows: torch.Tensor,
    draft_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [rows] long and accepted [rows] bool. weights: [rows, vocab] after the
    filters (consumed: draft weights are zeroed); u_*: [rows] float64 in [0, 1).
    A row with a draft (draft_rows, draft_ids: [num_drafts] long) accepts it with
    probability p(draft), and its token is drawn from p without the draft (the caller
    uses it only on rejection); a row without one draws its token from p."""
    accepted = torch.zeros(u_accept.shape, dtype=torch.bool, device=weights.device)
    if draft_rows.numel():
        total = weights.sum(-1)[draft_rows].double()
        p_draft = weights[draft_rows, draft_ids].double() / total
        accepted[draft_rows] = u_accept[draft_rows] < p_draft  # P(u < p) = p exactly
        remove_draft_(weights, draft_rows, draft_ids)
    return inverse_cdf(weights, u_sample), accepted

"""An upper bound on the goodput any admission policy can reach on a trace with bursts of
lumps, computed from the trace and the roofline step-time model alone: no policy is run.

    met <= (requests outside the bursts that can finish at all)
           + sum over bursts of K_b
    K_b  =  the most of burst b's requests whose least work fits between the burst's first
            arrival and its last deadline (arrival + TTFT target): the smallest first
    goodput <= met / D_min, D_min = the shortest a run can last (first arrival to the end)

Why it is an upper bound (for the simulator's roofline, `search.sim.step_time`):

- A step takes at least its tower time plus its dense compute time (`step_time`: ViT +
  max(compute, memory) + overhead), both linear in what it runs (tiles; rows and
  (query, key) pairs), so the card's time over a window is at least the sum of the least
  compute of the requests it works on in that window.
- A request meets its TTFT target only if its whole uncached prompt and its new images
  are computed after it arrives and before its deadline. Its least work: the ViT on the
  tiles of its images no other request of the trace carries (a shared image may come from
  the encoder cache), plus 2·P FLOPs a prompt token past the longest prefix it shares with
  any other request (system prompt and leading images: what the prefix cache could hold),
  plus 4·L·d FLOPs per (query, key) pair, at least Σ p over its positions p (the
  simulator prices a chunk of n rows after c tokens at n·(c + n), at least that sum for any
  chunking; a sliding-window layer's at n·min(c + n, W), at least Σ min(p, W)). So the
  burst requests that meet the SLO all do their least work inside [the burst's first
  arrival, its last deadline], and no more of them than K_b can.
- Every step with a dense row reads the weights (memory time >= weight bytes / bandwidth),
  and a request emits one token a step, so no run ends before, for every request,
  arrival + its least work + (max_tokens - 1) weight reads; summarize divides by the run
  from the first arrival to its end.

It leaves out (so it is loose, never below what a policy reaches): the other requests'
work inside a burst's window, TPOT targets, per-step overheads, memory-bound steps, the
KV pool. It is not a bound for a `MeasuredStepCost` (refused).

Not used: simulating the burst alone (text removed) under FCFS and lumpy and taking the
better. Removing traffic cannot lower the best any policy reaches on the burst, but FCFS
and lumpy are not that best: a third policy might meet more of the burst, so the count
they reach is no upper bound. It is reported beside this one for comparison only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from search.costmodel import cost_model as cm
from search.image_budget import vit_flops
from search.sim.step_time import StepHardware, sliding_window_of
from search.sim.trace_sim import make_sequence
from search.sim.traces import TraceRequest


@dataclass(frozen=True)
class GoodputBound:
    max_met: int  # requests any policy can serve within the SLO, at most
    max_met_per_burst: tuple[int, ...]  # K_b
    min_duration_s: float  # D_min
    goodput_rps: float  # max_met / D_min


class _Shared:
    """What other requests of a trace also carry: images, and leading image sequences
    (with the same system prompt, a prefix the prefix cache could hold)."""

    def __init__(self, trace: list[TraceRequest]) -> None:
        self.images = Counter(h for r in trace for h in {im.content_hash for im in r.images})
        self.leads = Counter(
            (r.num_system_tokens, tuple(im.content_hash for im in r.images[:n]))
            for r in trace
            for n in range(1, len(r.images) + 1)
        )

    def lead(self, req: TraceRequest) -> int:
        """Leading images of `req` another request also starts with."""
        n = 0
        while (
            n < len(req.images)
            and self.leads[
                (req.num_system_tokens, tuple(im.content_hash for im in req.images[: n + 1]))
            ]
            >= 2
        ):
            n += 1
        return n


def _window_sum(num_positions: int, window: int) -> int:
    """Σ over positions p < `num_positions` of min(p + 1, window)."""
    inside = min(num_positions, window)
    return inside * (inside + 1) // 2 + (num_positions - inside) * window


def least_work_s(
    req: TraceRequest, shared: _Shared, hw: StepHardware, pooling_ratio: int = 4
) -> float:
    """Seconds of card time `req`'s first token needs at least (see the module docstring)."""
    seq = make_sequence(req, hw, pooling_ratio, 0)
    tiles = sum(im.num_tiles for im in req.images if shared.images[im.content_hash] == 1)
    cached = req.num_system_tokens + sum(img.num_tokens for img in seq.images[: shared.lead(req)])
    total = seq.num_prompt_tokens
    cached = min(cached, total - 1)  # one token is always computed (its logits)
    model, a, peak = hw.model, hw.assumptions, hw.accel.peak_flops("bf16")
    pairs = (total * (total + 1) - cached * (cached + 1)) // 2
    flops = 2 * model.num_params * (total - cached)
    window = sliding_window_of(model)
    if window is None:
        flops += 4 * model.num_layers * model.hidden_size * float(pairs)
    else:  # sliding layers: position p attends min(p + 1, window) keys at least
        num_sliding = model.num_sliding_layers
        layer_pairs = (model.num_layers - num_sliding) * float(pairs)
        layer_pairs += num_sliding * float(_window_sum(total, window) - _window_sum(cached, window))
        flops += 4 * model.hidden_size * layer_pairs
    vit_s = cm.compute_time(vit_flops(hw.encoder, tiles), peak, a.vit_efficiency) if tiles else 0.0
    return vit_s + cm.compute_time(flops, peak, a.prefill_efficiency)


def goodput_bound(
    trace: list[TraceRequest], bursts: list[list[TraceRequest]], ttft_s: float, hw: StepHardware,
    finishes: set[str],
) -> GoodputBound:  # fmt: skip
    """The bound for `trace` whose `bursts` (disjoint groups of its requests) are bounded
    by K_b; the others count as met if they finish at all (`finishes`: their ids)."""
    if hw.measured is not None:
        raise ValueError("the bound holds for the roofline step time, not a measured fit")
    in_burst = {r.request_id for b in bursts for r in b}
    met = sum(1 for r in trace if r.request_id not in in_burst and r.request_id in finishes)
    shared = _Shared(trace)
    works = {r.request_id: least_work_s(r, shared, hw) for r in trace if r.request_id in finishes}
    per_burst = []
    for burst in bursts:
        window = max(r.arrival_s for r in burst) + ttft_s - min(r.arrival_s for r in burst)
        k, used = 0, 0.0
        for w in sorted(works[r.request_id] for r in burst if r.request_id in finishes):
            if used + w > window:
                break
            k, used = k + 1, used + w
        per_burst.append(k)
    weights_s = (
        cm.weight_bytes_total(hw.model, hw.assumptions.weight_bytes) / hw.accel.mem_bandwidth
    )
    start = min(r.arrival_s for r in trace)
    end = max(
        r.arrival_s + works[r.request_id] + (r.max_tokens - 1) * weights_s
        for r in trace
        if r.request_id in finishes
    )
    max_met = met + sum(per_burst)
    return GoodputBound(max_met, tuple(per_burst), end - start, max_met / (end - start))

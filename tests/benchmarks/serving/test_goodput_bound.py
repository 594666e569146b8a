"""benchmarks/serving/goodput_bound.py: the least work of a request against the step-time
model that prices it, and the bound against what simulated policies reach."""

from __future__ import annotations

import pytest

from benchmarks.serving.goodput_bound import _Shared, goodput_bound, least_work_s
from search.costmodel.presets import get_accelerator, get_encoder, get_model
from search.sim.capacity import Slo
from search.sim.step_time import StepHardware, StepWork, count_work, step_time
from search.sim.trace_sim import SimConfig, make_sequence, simulate
from search.sim.traces import SYSTEM_TOKENS, TraceImage, TraceRequest

HW = StepHardware(get_model("mha-7b"), get_encoder("siglip-so400m-14-384"), get_accelerator("h100"))


def burst_trace(num_burst: int, window_s: float) -> list[TraceRequest]:
    """Text every 50 ms for 4 s; `num_burst` requests of four new 13-tile images within
    `window_s` of t=1 s."""
    trace = [TraceRequest(f"t{i}", 0.05 * i, "text", 100, 20, (), SYSTEM_TOKENS) for i in range(80)]
    for i in range(num_burst):
        images = tuple(TraceImage(f"b{i}-{k}", 13) for k in range(4))
        at = 1.0 + window_s * i / max(1, num_burst - 1)
        trace.append(TraceRequest(f"b{i}", at, "burst", 30, 8, images, SYSTEM_TOKENS))
    return sorted(trace, key=lambda r: r.arrival_s)


def test_least_work_is_at_most_the_request_alone_in_one_step():
    trace = burst_trace(2, 0.0)
    req = next(r for r in trace if r.request_id == "b0")
    seq = make_sequence(req, HW, 4, 0)
    n, cached = seq.num_prompt_tokens, SYSTEM_TOKENS
    alone = step_time(StepWork(n - cached, 0, (n - cached) * n, n, 52, 1), HW).total_s
    least = least_work_s(req, _Shared(trace), HW)
    assert 0.8 * alone < least <= alone
    # A second request carrying the same images: no tower work for either.
    shared = [*trace, TraceRequest("copy", 2.0, "burst", 5, 1, req.images, SYSTEM_TOKENS)]
    assert least_work_s(req, _Shared(shared), HW) < least


def test_least_work_of_a_sliding_window_model_is_at_most_its_priced_steps():
    """Gemma 3 4B, a 6,000-token prompt: the least work counts the sliding layers' pairs
    within their window, so it stays under the simulator's price of the prompt in one step
    or in chunks of 2,048 (all-global pairs would put it over both)."""
    gemma = StepHardware(get_model("gemma-3-4b"), get_encoder("siglip-so400m-14-896"), HW.accel)
    req = TraceRequest("long", 0.0, "text", 6000, 1, (), 0)
    n = make_sequence(req, gemma, 4, 0).num_prompt_tokens
    least = least_work_s(req, _Shared([req]), gemma)
    alone = step_time(count_work([(0, n, False)], 0, 1024), gemma).total_s
    chunks = [(c, min(2048, n - c), False) for c in range(0, n, 2048)]
    chunked = sum(step_time(count_work([chunk], 0, 1024), gemma).total_s for chunk in chunks)
    assert 0.5 * alone < least <= min(alone, chunked)


@pytest.mark.parametrize("window_s", [0.0, 2.0])
def test_no_simulated_policy_passes_the_bound(window_s):
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    trace = burst_trace(12, window_s)
    burst = [r for r in trace if r.request_class == "burst"]
    finishes = {r.request_id for r in trace}
    bound = goodput_bound(trace, [burst], slo.ttft_s, HW, finishes)
    work = min(least_work_s(r, _Shared(trace), HW) for r in burst)
    # All arrive at once: as many as the least work fits into the 1 s target, at most.
    assert bound.max_met_per_burst[0] <= max(1, int((window_s + 1.0) / work))
    assert bound.max_met_per_burst[0] < len(burst)
    for admission in ("fcfs", "lumpy"):
        result = simulate(trace, HW, SimConfig(admission=admission))
        met = sum(slo.met_by(r) for r in result.records)
        duration = result.end_s - min(r.arrival_s for r in trace)
        assert met <= bound.max_met and duration >= bound.min_duration_s
        assert met / duration <= bound.goodput_rps

"""The forward thread of async scheduling (NanoFlow §4.2.1; vLLM's `async_scheduling`,
SGLang's overlap scheduler).

The engine thread launches step i+1 here and, while it runs, takes step i's tokens
(stop checks, detokenising, the scheduler's bookkeeping) and plans step i+2. Torch drops
the GIL inside its ops, so the two threads overlap, but only there: the forward's Python
between ops waits for the GIL while the engine thread runs (on a GPU the forward thread
spends most of a step waiting on the device, with the GIL free).

What must stay true: steps run one at a time, in launch order. That order is what lets a
step read the tokens the step before it sampled (its pending rows) without the engine
thread in between, and what makes it safe for the engine to free the KV blocks of a
request that finished while a step that still writes them is in flight.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from scheduler.step_plan import ScheduledSeq
from vlmserve.sample.logprobs import book_prompt_logprobs
from vlmserve.sample.params import SamplerState
from vlmserve.sample.verify import greedy_plan, sample_plan, start_masks, takes_argmax
from vlmserve.worker.runner import ModelRunner, StepInputs

Sampled = list[list[int] | Exception]  # per plan item, as `sample_plan` returns it

# The engine thread's Python (stop checks, detokenising, planning) and the forward's
# Python between ops share the GIL. At CPython's default switch interval (5 ms) an op
# that ends while the engine thread runs waits up to 5 ms to go on, and the next step
# waits as long to start; at 0.5 ms benchmarks/engine/async_scheduling.py hides about twice as
# much of the host's time as at 5 ms, and going lower gains nothing (its results file).
# Lowered process-wide, never raised.
SWITCH_INTERVAL_S = 0.0005


@dataclass
class StepTimes:
    """Where the engine's time went, summed over steps (benchmarks/engine/async_scheduling.py)."""

    # Engine thread CPU time outside the forward: planning, the vision tower, building
    # inputs, stop checks, detokenising, bookkeeping (time.thread_time).
    host_s: float = 0.0
    # Forward + sampling (on the forward thread when async): wall and that thread's CPU.
    forward_s: float = 0.0
    forward_cpu_s: float = 0.0
    # The part of forward_s spent sampling (logit controls, grammar masks, the draw).
    sample_s: float = 0.0
    # Wall time between the end of one forward and the start of the next: the device (or
    # here the forward's thread) idle while the host works. Sync: all of the host's time;
    # async: what the overlap did not hide.
    forward_idle_s: float = 0.0
    # Engine thread blocked on the forward thread (async only).
    wait_s: float = 0.0
    last_forward_end: float | None = None  # perf_counter()


class ForwardThread:
    """Runs launched steps' forward and sampling, one at a time in launch order."""

    def __init__(self, runner: ModelRunner, times: StepTimes) -> None:
        self._runner = runner
        self._times = times
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        # A new thread starts with OpenMP's default thread count, not the one torch was
        # set to: set it, or a 1-thread engine would compute on every core.
        self._executor = ThreadPoolExecutor(
            1, "vlmserve-forward", initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )  # fmt: skip

    def submit(
        self,
        inputs: StepInputs,
        scheduled: list[ScheduledSeq],
        samplers: list[SamplerState],
        previous: Future[Sampled] | None,
        prompt_samplers: Mapping[str, SamplerState] | None = None,
    ) -> Future[Sampled]:
        """Queue a step; `previous`: the step launched before it (its pending rows take
        their tokens from that step's output)."""
        return self._executor.submit(
            self._run, inputs, scheduled, samplers, previous, prompt_samplers
        )

    def _run(
        self,
        inputs: StepInputs,
        scheduled: list[ScheduledSeq],
        samplers: list[SamplerState],
        previous: Future[Sampled] | None,
        prompt_samplers: Mapping[str, SamplerState] | None,
    ) -> Sampled:
        # Done already (this thread ran it); None when its forward raised.
        before = None
        if previous is not None and previous.exception() is None:
            before = previous.result()
        return run_step(
            self._runner, self._times, inputs, scheduled, samplers, before, prompt_samplers
        )


def run_step(
    runner: ModelRunner,
    times: StepTimes,
    inputs: StepInputs,
    scheduled: list[ScheduledSeq],
    samplers: list[SamplerState],
    previous: Sampled | None = None,
    prompt_samplers: Mapping[str, SamplerState] | None = None,
) -> Sampled:
    """Forward and sampling of one step, timed into `times`; `previous`: the output of the
    step before, for the pending rows (async); `prompt_samplers`: the states of the
    requests whose prompt logprobs the step's `prompt_spans` hold."""
    wall, cpu = time.perf_counter(), time.thread_time()
    if times.last_forward_end is not None:
        times.forward_idle_s += wall - times.last_forward_end
    try:
        # Constrained rows: their grammar masks fill on another thread meanwhile.
        masks = start_masks(scheduled, samplers, runner.model.decoder.cfg.vocab_size)
        # Greedy alone: the head gives each row's argmax (no [rows, vocab] logits where
        # it can), and the plan its tokens from them.
        greedy = not inputs.prompt_spans and takes_argmax(samplers)
        out = runner.run(inputs, previous, greedy)  # argmaxes when greedy, else logits
        sampling = time.perf_counter()
        if greedy:
            sampled = greedy_plan(scheduled, out, samplers)
        else:
            sampled = sample_plan(scheduled, out, samplers, masks)
        times.sample_s += time.perf_counter() - sampling
        if inputs.prompt_spans:
            book_prompt_logprobs(out, inputs.prompt_spans, prompt_samplers or {})
        return sampled
    finally:
        times.last_forward_end = time.perf_counter()
        times.forward_s += times.last_forward_end - wall
        times.forward_cpu_s += time.thread_time() - cpu

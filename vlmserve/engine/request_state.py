"""The engine's records of a request it serves and of a step in flight (core.py's)."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

from scheduler.in_flight import LaunchedStep
from scheduler.sequence import Sequence
from scheduler.step_plan import StepPlan
from vlmserve.engine.detokenizer import IncrementalDetokenizer
from vlmserve.engine.forward_thread import Sampled
from vlmserve.engine.outputs import FinishReason, RequestOutput
from vlmserve.sample.params import SamplerState, SamplingParams

Kept = dict[str, tuple[list[int], FinishReason | None]]  # request id -> (tokens, why it ended)


@dataclass
class RequestState:
    seq: Sequence
    params: SamplingParams
    sampler: SamplerState
    max_tokens: int
    output: RequestOutput
    detokenizer: IncrementalDetokenizer
    stop_token_ids: frozenset[int]  # its own and, unless ignore_eos, the model's EOS ids
    works: list[object]  # its images' encoder records (the runner has them too)


@dataclass(frozen=True)
class InFlightStep:
    """A step launched on the forward thread whose output the engine has not taken."""

    step: LaunchedStep
    states: list[RequestState]  # per plan item
    future: futures.Future[Sampled]


def samplers_of(plan: StepPlan, states: list[RequestState]) -> list[SamplerState]:
    """One sampler per sampling item of `plan`, in plan order (`sample_plan`'s input)."""
    return [s.sampler for s, item in zip(states, plan.scheduled, strict=True) if item.sample]

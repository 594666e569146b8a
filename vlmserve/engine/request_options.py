"""The per-request sampling options the engine sets up beside the scheduler: the sampler's
inputs for the logit controls (prompt, stop ids, bad words as token ids), the output's
logprobs, and n > 1 as n requests that share the prompt's KV.

n > 1: child i is a request of its own (id `<id>-<i>`, seed + i when seeded, as vLLM's
parallel sampling), so streaming, aborts and failures stay per request. Children 1..n-1
are held out of the scheduler until child 0 has its first token: by then its prompt's full
blocks are in the prefix cache, so each child computes only the partial last block and
the prompt's KV is shared (needs `enable_prefix_caching`, the default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from scheduler.step_plan import StepPlan
from vlmserve.engine.outputs import PreparedRequest, RequestOutput
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplerState, SamplingParams

if TYPE_CHECKING:
    from vlmserve.engine.core import Engine


def bad_words_ids(tokenizer, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token ids, alone and after a space (as vLLM: a word mid-sentence
    usually tokenises with its leading space)."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming a logit_bias / stop_token_ids id outside the vocabulary."""
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise ValueError(
                f"logit_bias: token id {token} is outside the vocabulary of {vocab_size}"
            )
    for token in params.stop_token_ids:
        if not 0 <= token < vocab_size:
            raise ValueError(f"stop_token_ids: {token} is outside the vocabulary of {vocab_size}")


def make_sampler(
    params: SamplingParams, prompt_token_ids: list[int], stop_ids: Iterable[int], tokenizer
) -> SamplerState:
    state = SamplerState(params)
    if params.has_logit_controls or params.prompt_logprobs is not None:
        state.prompt_token_ids = tuple(prompt_token_ids)
    if params.has_logit_controls:
        state.stop_token_ids = tuple(sorted(stop_ids))
        state.bad_words_ids = bad_words_ids(tokenizer, params.bad_words)
    return state


def take_logprobs(state: SamplerState, output: RequestOutput, num_kept: int) -> None:
    """Move the step's logprob records (sampled on the forward thread) onto `output`, cut
    to the tokens the request kept."""
    if state.params.logprobs is None:
        return
    records = state.logprobs.popleft()[:num_kept] if state.logprobs else []
    output.new_logprobs = records
    output.logprobs.extend(records)
    output.cumulative_logprob += sum(r.logprob for r in records)


def take_prompt_logprobs(state: SamplerState, output: RequestOutput) -> None:
    """Move the prompt logprobs the prefill computed onto `output` by position (a chunk
    recomputed after a preemption overwrites the same positions)."""
    while state.prompt_logprobs:
        position, records = state.prompt_logprobs.popleft()
        output.prompt_logprobs[position : position + len(records)] = records


def prompt_logit_requests(
    plan: StepPlan, states: Mapping
) -> tuple[dict[str, int] | None, dict[str, SamplerState] | None]:
    """The runner's `prompt_logits` (request id -> prompt length) for the plan's items that
    want prompt logprobs and are still in their prompt, and their samplers."""
    wants, samplers = {}, {}
    for item in plan.scheduled:
        state = states[item.request_id]
        if state.params.prompt_logprobs is None:
            continue
        num_prompt = state.output.num_prompt_tokens
        if item.num_computed_tokens < num_prompt - 1:
            wants[item.request_id] = num_prompt
            samplers[item.request_id] = state.sampler
    return (wants, samplers) if wants else (None, None)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index` of an n > 1 (or best_of) request: one answer, its own seed stream;
    best_of children keep the sampled token's logprob, their ranking key."""
    seed = None if params.seed is None else params.seed + index
    logprobs = params.logprobs
    if params.best_of is not None and params.best_of > params.n and logprobs is None:
        logprobs = 0
    # The prompt's logprobs are the same for every child: child 0 computes them (the
    # others then share its prompt KV through the prefix cache).
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(
        params, n=1, best_of=None, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )


def num_children(params: SamplingParams) -> int:
    return max(params.n, params.best_of or 0)


def pick_best(outputs: list[RequestOutput], params: SamplingParams | None) -> list[RequestOutput]:
    """best_of > n: the n outputs of highest cumulative logprob, best first (vLLM's rule);
    otherwise `outputs` as they are."""
    if params is None or params.best_of is None or params.best_of <= params.n:
        return outputs
    return sorted(outputs, key=lambda out: out.cumulative_logprob, reverse=True)[: params.n]


def generate_all(engine: Engine, requests: list[Request]) -> list[RequestOutput]:
    """`Engine.generate`: n outputs in a row for a request with n > 1."""
    groups: list[list[RequestOutput]] = []
    for request in requests:
        try:
            ids = add_with_children(engine, request)
            groups.append([engine._states[request_id].output for request_id in ids])
        except ValueError as e:  # RequestError and input validation
            rid = request.request_id or f"req-{next(engine._ids)}"
            groups.append([RequestOutput(rid, finished=True, finish_reason="error", error=str(e))])
    while engine.has_unfinished():
        engine.step()
    return [
        out
        for group, request in zip(groups, requests, strict=True)
        for out in pick_best(group, request.sampling)
    ]


def add_with_children(engine: Engine, request: Request) -> list[str]:
    """Add `request`, or its n (best_of) children `<id>-<i>` sharing one preparation."""
    params = request.sampling or SamplingParams()
    if num_children(params) == 1:
        return [engine.add_request(request)]
    prepared = engine.prepare(request)
    base = prepared.request_id or f"req-{next(engine._ids)}"
    ids = [f"{base}-{i}" for i in range(num_children(params))]
    for i, request_id in enumerate(ids):
        share = ids[0] if i else None
        engine.add_request(child_request(prepared, request_id, child_params(params, i), share))
    return ids


def child_request(
    prepared: PreparedRequest, request_id: str, params: SamplingParams, share: str | None
) -> PreparedRequest:
    """One of the n requests made from one preparation (template, tokens, images done
    once): its own id and parameters, a matcher of its own over the shared compile."""
    grammar = prepared.grammar.fork() if prepared.grammar is not None else None
    return dataclasses.replace(
        prepared, request_id=request_id, params=params, share_prompt_with=share, grammar=grammar
    )

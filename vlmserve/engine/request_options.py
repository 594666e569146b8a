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
from collections.abc import Iterable

from vlmserve.engine.outputs import RequestOutput
from vlmserve.sample.params import SamplerState, SamplingParams


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
    if params.has_logit_controls:
        state.prompt_token_ids = tuple(prompt_token_ids)
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


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index` of an n > 1 (or best_of) request: one answer, its own seed stream;
    best_of children keep the sampled token's logprob, their ranking key."""
    seed = None if params.seed is None else params.seed + index
    logprobs = params.logprobs
    if params.best_of is not None and params.best_of > params.n and logprobs is None:
        logprobs = 0
    return dataclasses.replace(params, n=1, best_of=None, seed=seed, logprobs=logprobs)


def num_children(params: SamplingParams) -> int:
    return max(params.n, params.best_of or 0)


def pick_best(outputs: list[RequestOutput], params: SamplingParams | None) -> list[RequestOutput]:
    """best_of > n: the n outputs of highest cumulative logprob, best first (vLLM's rule);
    otherwise `outputs` as they are."""
    if params is None or params.best_of is None or params.best_of <= params.n:
        return outputs
    return sorted(outputs, key=lambda out: out.cumulative_logprob, reverse=True)[: params.n]

"""The engine loop: requests in, tokens out.

`add_request` validates and tokenises, `step` runs one scheduler plan through the model
and returns what each touched request produced, `generate` drives both to completion.
The HTTP server drives the same `add_request / step` loop from its own thread.

Fault isolation inside a step: a failure that belongs to one request (its image's
decode or encode, its sampling) fails that request alone, and the step runs on without
it; a failure that belongs to no request (the forward pass raising, e.g. device OOM)
fails the step's requests and frees their blocks. Either way the failed requests come
back as outputs with `finish_reason="error"`, and the engine keeps serving. An
exception escaping `step` is a bug in the engine's own bookkeeping.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from encoders.errors import PromptTooLongError, RequestError
from encoders.stage import ImageWork
from scheduler.planner import Scheduler, StepPlan
from scheduler.sequence import Sequence
from scheduler.spec_policy import SpecMetrics
from vlmserve.config import EngineConfig
from vlmserve.detokenizer import IncrementalDetokenizer
from vlmserve.processing import (
    ProcessedPrompt,
    Request,
    check_prompt_chars,
    make_prompt_processor,
)
from vlmserve.runner import ModelRunner
from vlmserve.sampling import SamplerState, SamplingParams
from vlmserve.spec_decode import ridge_batch_for, sample_plan

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort", "error"]

# Longest an idle step waits for an image decode (the engine thread has nothing else).
_IMAGE_POLL_S = 0.005


class StepFailedError(RuntimeError):
    """The engine failed on this request (not on its input): 500. The cause is logged,
    not sent to the client."""

    status = 500


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)  # since the previous step
    text: str = ""  # all of it so far, cut at a stop string
    # Text not handed out before; held back while a stop string could still cut it.
    text_delta: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_status: int | None = None  # HTTP status of `error`: 4xx its input, 5xx ours
    error_type: str | None = None  # the error's class (RequestError subclasses by name)
    num_prompt_tokens: int = 0
    num_image_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class PreparedRequest:
    """A request after `Engine.prepare`: tokens, image placeholders, checked limits."""

    request_id: str | None
    prompt: ProcessedPrompt
    params: SamplingParams
    max_tokens: int


@dataclass
class _State:
    seq: Sequence
    params: SamplingParams
    sampler: SamplerState
    max_tokens: int
    output: RequestOutput
    detokenizer: IncrementalDetokenizer


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        model = self.runner.model
        self.processor = make_prompt_processor(
            config.model.path, model, config.model.max_images_per_request,
            encoder=config.encoder, encoder_cache=self.runner.encoder_cache,
        )  # fmt: skip
        self.tokenizer = self.processor.tokenizer
        # The engine thread's own copy: preparer threads tokenise with theirs meanwhile.
        self._detok_tokenizer = copy.deepcopy(self.tokenizer)
        context = model.decoder.cfg.max_position_embeddings
        self.max_model_len = min(config.model.max_model_len or context, context)
        speculative = config.speculative
        if speculative.enabled and speculative.adaptive and speculative.ridge_batch is None:
            ridge = ridge_batch_for(self.runner.device, self.runner.dtype)
            speculative = dataclasses.replace(speculative, ridge_batch=ridge)
        cache = self.runner.encoder_cache  # pool images: content_hash is the cache key
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.runner.num_blocks, speculative=speculative,
            encoder_cached=cache.__contains__,
        )  # fmt: skip
        self.eos_token_ids = _eos_token_ids(config.model.path, model.config, self.tokenizer)
        self._states: dict[str, _State] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens actually run (cache misses)

    # -- requests ---------------------------------------------------------------------

    def prepare(self, request: Request) -> PreparedRequest:
        """The CPU work of admitting `request`: chat template, tokenisation, image decode and
        tiling (on the preprocessing pool), and the length checks. Safe to call from other
        threads while the engine steps, so a server can overlap it with decoding. Raises
        RequestError (or ValueError) for a request that cannot be served."""
        params = request.sampling or SamplingParams()
        check_prompt_chars(request, self.max_model_len)  # before any tokenising
        prompt = self.processor.process(request)
        num_prompt = len(prompt.token_ids)
        if num_prompt >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {num_prompt} tokens, the model's context is {self.max_model_len} "
                "tokens (and at least one must be left to generate)"
            )
        max_tokens = min(params.max_tokens, self.max_model_len - num_prompt)
        refusal = self.scheduler.check_fits(num_prompt, max_tokens)
        if refusal is not None:  # never admissible: refused now, never a hang
            raise RequestError(refusal)
        return PreparedRequest(request.request_id, prompt, params, max_tokens)

    def add_request(self, request: Request | PreparedRequest) -> str:
        """Queue `request` (preparing it first unless it already is); returns its id. Raises
        RequestError (or ValueError) for a request that cannot be served; nothing else is
        disturbed."""
        if isinstance(request, Request):
            request = self.prepare(request)
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request_id in self._states:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt, params = request.prompt, request.params
        num_prompt = len(prompt.token_ids)
        seq = Sequence(request_id, list(prompt.token_ids), prompt.images)
        output = RequestOutput(
            request_id,
            num_prompt_tokens=num_prompt,
            num_image_tokens=sum(image.num_tokens for image in prompt.images),
        )
        detokenizer = IncrementalDetokenizer(self._detok_tokenizer, params.stop)
        state = _State(seq, params, SamplerState(params), request.max_tokens, output, detokenizer)
        self._states[request_id] = state
        # Its images may still be decoding in the pool: queued now, admitted once ready.
        seq.ready = not _pending_images(seq)
        self.scheduler.add(seq, num_prompt + request.max_tokens)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._states.get(request_id)
        if state is None:
            return None
        self._finish(state, "abort")
        return state.output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: plan, run, sample, advance. Returns the outputs of requests that
        produced tokens or finished (failed ones included) in this step."""
        failed = self._poll_images()
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self.runner.preempt(seq)
        if plan.is_empty:
            if not failed:
                self._wait_for_images()
            return failed
        failed += [
            self._fail(self._states[request_id], error)
            for request_id, error in self.runner.encode_images(plan).items()
        ]
        plan = self._without(plan, {out.request_id for out in failed})
        if plan.is_empty:
            return failed
        try:
            logits = self.runner.execute(plan)
        except Exception as e:  # noqa: BLE001 - belongs to no one request: fail the step's
            log.exception("forward pass failed; failing the %d requests in it", len(plan.scheduled))
            return failed + [
                self._fail(self._states[item.seq.request_id], StepFailedError(str(e)))
                for item in plan.scheduled
            ]
        states = [self._states[item.seq.request_id] for item in plan.scheduled]
        samplers = [
            s.sampler for s, item in zip(states, plan.scheduled, strict=True) if item.sample
        ]
        sampled = sample_plan(plan.scheduled, logits, samplers)
        accepted: dict[str, tuple[list[int], FinishReason | None]] = {}
        for state, new in zip(states, sampled, strict=True):
            if isinstance(new, Exception):
                log.error("sampling failed for %s: %r", state.seq.request_id, new)
                failed.append(self._fail(state, StepFailedError(f"sampling failed: {new}")))
            elif new:
                accepted[state.seq.request_id] = self._accept(state, new)
        plan = self._without(plan, {out.request_id for out in failed})
        self._count_prompt_work(plan)
        self.scheduler.update(
            plan, [accepted.get(item.seq.request_id, ([], None))[0] for item in plan.scheduled]
        )
        self.num_steps += 1
        outputs = failed
        for request_id, (tokens, reason) in accepted.items():
            state = self._states[request_id]
            out = state.output
            out.new_token_ids = tokens
            out.token_ids.extend(tokens)
            out.text = state.detokenizer.text
            if reason is not None:
                self._finish(state, reason)
            out.text_delta = state.detokenizer.take_delta(out.finished)
            outputs.append(out)
        return outputs

    def _poll_images(self) -> list[RequestOutput]:
        """Mark waiting sequences whose images are decoded ready; fail (alone) those
        whose decode failed. Never blocks."""
        failed = []
        for seq in [s for s in self.scheduler.waiting if not s.ready]:
            if _pending_images(seq):
                continue
            try:
                for image in seq.images:
                    if isinstance(image.data, ImageWork):
                        image.data.wait()  # done: records timings, raises a decode error
            except Exception as e:  # noqa: BLE001 - this request's image alone
                failed.append(self._fail(self._states[seq.request_id], e))
                continue
            seq.ready = True
        return failed

    def _wait_for_images(self) -> None:
        """Nothing to run but images still decoding: wait briefly for one of them rather
        than spin (short, so new requests and aborts are still taken promptly)."""
        pending = [f for s in self.scheduler.waiting for f in _pending_images(s)]
        if pending:
            futures.wait(pending, timeout=_IMAGE_POLL_S, return_when=futures.FIRST_COMPLETED)

    @staticmethod
    def _without(plan: StepPlan, request_ids: set[str]) -> StepPlan:
        if not request_ids:
            return plan
        kept = [item for item in plan.scheduled if item.seq.request_id not in request_ids]
        return StepPlan(kept, plan.preempted)

    def _count_prompt_work(self, plan: StepPlan) -> None:
        for item in plan.scheduled:
            start = item.seq.num_computed_tokens
            end = min(start + item.num_new_tokens, item.seq.num_prompt_tokens)
            self.num_computed_prompt_tokens += max(0, end - start)

    def _stop_token_ids(self, params: SamplingParams) -> set[int]:
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.eos_token_ids
        return stops

    def _accept(self, state: _State, new: list[int]) -> tuple[list[int], FinishReason | None]:
        """`new` up to and including the first token that ends the request (a stop id, a
        completed stop string, max_tokens or the context), as plain decoding would stop:
        accepted drafts past it are dropped. Feeds the detokenizer token by token."""
        stops = self._stop_token_ids(state.params)
        num_done = len(state.output.token_ids)
        num_prompt = state.output.num_prompt_tokens
        for i, token in enumerate(new):
            state.detokenizer.add(token)
            num_out = num_done + i + 1
            if token in stops or state.detokenizer.stopped:
                return new[: i + 1], "stop"
            if num_out >= state.max_tokens or num_prompt + num_out >= self.max_model_len:
                return new[: i + 1], "length"
        return new, None

    def _fail(self, state: _State, error: Exception) -> RequestOutput:
        """Finish `state` with `error`: a RequestError's message and status, or 500."""
        out = state.output
        if isinstance(error, RequestError):
            out.error, out.error_status = str(error), error.status
            out.error_type = type(error).__name__
        else:
            out.error_type = "InternalError"
            if not isinstance(error, StepFailedError):
                log.error("request %s failed: %r", state.seq.request_id, error)
            out.error = "the engine failed on this request (internal error; see the server log)"
            out.error_status = 500
        out.new_token_ids, out.text_delta = [], ""
        self._finish(state, "error")
        return out

    def _finish(self, state: _State, reason: FinishReason) -> None:
        state.output.finished = True
        state.output.finish_reason = reason
        state.output.num_cached_tokens = state.seq.num_cached_tokens
        self.scheduler.finish(state.seq)
        self.runner.release(state.seq.request_id)
        del self._states[state.seq.request_id]

    def stats(self) -> dict[str, float]:
        """Engine-side gauges and counters for metrics: queue, KV pool, prefix and encoder
        caches, preprocessing stage seconds, speculation."""
        scheduler, bm = self.scheduler, self.scheduler.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        stats = {
            "waiting": float(len(scheduler.waiting)),
            "running": float(len(scheduler.running)),
            "num_blocks": float(bm.num_blocks),
            "free_blocks": float(bm.num_free_blocks),
            "used_blocks": float(used),
            "kv_usage": used / bm.num_blocks,
            "num_steps": float(self.num_steps),
            "num_preemptions": float(scheduler.num_preemptions),
            "recomputed_tokens_total": float(scheduler.num_recomputed_tokens),
            "computed_prompt_tokens": float(self.num_computed_prompt_tokens),
        }
        cache = self.runner.encoder_cache.stats()
        stats |= {
            "encoder_cache_hits": float(cache.hits),
            "encoder_cache_misses": float(cache.misses),
            "encoder_cache_bytes": float(cache.num_bytes),
        }
        pool = self.processor.pool_metrics()
        stats |= {f"preprocess_{k}": float(v) for k, v in pool.items()}
        spec = self.spec_metrics
        if spec is not None:
            stats |= {
                "spec_proposed": float(spec.num_proposed_tokens),
                "spec_accepted": float(spec.num_accepted_tokens),
            }
        return stats

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        """Speculation counters (proposed, accepted, mean accepted length); None when off."""
        policy = self.scheduler.spec_policy
        return policy.metrics if policy is not None else None

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run `requests` to completion. A request that cannot be served gets an output
        with `error` set; the others are unaffected."""
        outputs: list[RequestOutput] = []
        for request in requests:
            try:
                request_id = self.add_request(request)
                outputs.append(self._states[request_id].output)
            except ValueError as e:  # RequestError and input validation
                rid = request.request_id or f"req-{next(self._ids)}"
                outputs.append(
                    RequestOutput(rid, finished=True, finish_reason="error", error=str(e))
                )
        while self.has_unfinished():
            self.step()
        return outputs


def _pending_images(seq: Sequence) -> list[futures.Future]:
    """Futures of `seq`'s images still being decoded and tiled in the pool."""
    return [
        image.data.future
        for image in seq.images
        if isinstance(image.data, ImageWork)
        and image.data.future is not None
        and not image.data.future.done()
    ]


def _eos_token_ids(path: str, config: dict, tokenizer: object) -> set[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    sources = []
    gen_path = Path(path) / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    sources += [config.get("eos_token_id"), config.get("text_config", {}).get("eos_token_id")]
    sources.append(getattr(tokenizer, "eos_token_id", None))
    for value in sources:
        if value is not None:
            return set(value) if isinstance(value, list) else {int(value)}
    return set()

"""The engine loop: requests in, tokens out.

`add_request` validates and tokenises, `step` runs one scheduler plan through the model
and returns what each touched request produced, `generate` drives both to completion.
The HTTP server drives the same `add_request / step` loop from its own thread.

Async scheduling (`SchedulerConfig.async_scheduling`, NanoFlow §4.2.1): step i's forward
runs on the forward thread while this thread takes step i-1's tokens and plans step i+1
(`scheduler.in_flight`); a stop is seen a step late and the token computed meanwhile is
dropped, so the outputs are those of stepping in turn.

Fault isolation inside a step: a failure that belongs to one request (its image's
decode or encode, its sampling) fails that request alone, and the step runs on without
it; a failure that belongs to no request (the forward pass raising, e.g. device OOM)
fails the step's requests and frees their blocks. Either way the failed requests come
back as outputs with `finish_reason="error"`, and the engine keeps serving. An
exception escaping `step` is a bug in the engine's own bookkeeping.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent import futures

from encoders.errors import PromptTooLongError, RequestError
from scheduler.planner import Scheduler
from scheduler.sequence import Sequence
from scheduler.spans import image_spans
from scheduler.spec_policy import SpecMetrics
from scheduler.step_plan import ScheduledSeq, StepPlan
from search.costmodel.cost_model import spec_speedup
from vlmserve.config import EngineConfig
from vlmserve.engine.detokenizer import IncrementalDetokenizer, direct_decoder
from vlmserve.engine.forward_thread import ForwardThread, Sampled, StepTimes, run_step
from vlmserve.engine.grammars import LazyGrammars
from vlmserve.engine.image_wait import pending_images, poll_grammars, poll_images, wait_for_images
from vlmserve.engine.outputs import (
    FinishReason,
    NeverStartsError,
    PreparedRequest,
    RequestOutput,
    StepFailedError,
)
from vlmserve.engine.request_options import (
    check_vocab,
    generate_all,
    make_sampler,
    prompt_logit_requests,
    take_logprobs,
    take_prompt_logprobs,
)
from vlmserve.engine.request_state import InFlightStep, Kept, RequestState, samplers_of
from vlmserve.engine.stats import engine_stats
from vlmserve.engine.step_cost import OnlineStepCost
from vlmserve.engine.warmup import warm_up
from vlmserve.inputs.processing import Request, check_prompt_chars, eos_token_ids
from vlmserve.inputs.prompt_processor import make_prompt_processor
from vlmserve.sample.params import SamplingParams
from vlmserve.sample.verify import resolve_speculation
from vlmserve.worker.parallel.executor import make_runner

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = make_runner(config)  # tensor parallel: starts the other ranks
        model = self.runner.model
        self.processor = make_prompt_processor(
            config.model.path, model, config.model.max_images_per_request,
            encoder=config.encoder, encoder_cache=self.runner.encoder_cache,
        )  # fmt: skip
        self.tokenizer = self.processor.tokenizer
        # The engine thread's: preparer threads encode with the processor's private Rust
        # tokenizer or copies of their own, never with this one (chat templates only read).
        self._detok_tokenizer = self.tokenizer
        self._detok_decoder = direct_decoder(self._detok_tokenizer)  # the same text, faster
        self.max_model_len = self.runner.max_model_len  # the flag, capped by the context
        speculative = resolve_speculation(
            config, self.runner.device, self.runner.dtype, model.decoder
        )
        self._adaptive_spec = speculative.enabled and speculative.adaptive
        cache = self.runner.encoder_cache  # pool images: content_hash is the cache key
        # A TPOT target: the scheduler prices steps with a fit of this engine's own steps.
        self.step_cost = OnlineStepCost() if config.scheduler.slo.tpot_s is not None else None
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.runner.num_blocks, speculative=speculative,
            encoder_cached=cache.__contains__, spec_speedup=spec_speedup,
            step_cost=self.step_cost, clock=time.monotonic, kv_windows=self.runner.kv_windows,
        )  # fmt: skip
        self.eos_token_ids = eos_token_ids(config.model.path, model.config, self.tokenizer)
        self._states: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens actually run (cache misses)
        self.times = StepTimes()
        # Async scheduling, unless speculating: drafts are proposed from the tokens the
        # step before emitted, so a speculating engine waits for them.
        self.async_scheduling = config.scheduler.async_scheduling and not speculative.enabled
        self._forward = ForwardThread(self.runner, self.times) if self.async_scheduling else None
        self._in_flight: InFlightStep | None = None
        vocab = model.decoder.cfg.vocab_size  # structured outputs: made on the first one
        self.grammars = LazyGrammars(self._detok_tokenizer, vocab, self.eos_token_ids, config)
        self.peak_used_blocks = 0
        self._held: dict[str, str] = {}  # n > 1: request id -> the sibling it waits for
        # The step shapes live traffic will meet, run once before any request (`serve`).
        self.warmup = warm_up(self, config.warmup_max_seconds) if config.warmup else None

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
        check_vocab(params, self.runner.model.decoder.cfg.vocab_size)
        max_tokens = min(params.max_tokens, self.max_model_len - num_prompt)
        refusal = self.scheduler.check_fits(num_prompt, max_tokens)
        if refusal is not None:  # never admissible: refused now, never a hang
            raise RequestError(refusal)
        grammar = None
        if params.structured is not None:  # compiles on the grammar pool meanwhile
            grammar = self.grammars.get().request(params.structured)
        return PreparedRequest(
            request.request_id, prompt, params, max_tokens, request.share_prompt_with, grammar
        )

    def add_request(self, request: Request | PreparedRequest) -> str:
        """Queue `request` (preparing it first unless it already is); returns its id. Raises
        RequestError (or ValueError) for a request that cannot be served, disturbing nothing."""
        if isinstance(request, Request):
            request = self.prepare(request)
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request_id in self._states:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt, params = request.prompt, request.params
        if params.n > 1 or (params.best_of or 1) > 1:  # never one answer silently
            raise RequestError("n > 1 and best_of: Engine.generate (or the server) fans out")
        num_prompt = len(prompt.token_ids)
        seq = Sequence(request_id, list(prompt.token_ids), prompt.images)
        # Prompt logprobs need every prompt position computed: no prefix-cache hits.
        seq.use_prefix_cache = params.prompt_logprobs is None
        # A seeded sampled request's tokens must not depend on the load, which adaptive γ follows.
        seq.may_draft = not (self._adaptive_spec and params.seed is not None and not params.greedy)
        if self.runner.model.bidirectional_images:
            seq.spans = image_spans(prompt.images)
        output = RequestOutput(
            request_id,
            num_prompt_tokens=num_prompt,
            num_image_tokens=sum(image.num_tokens for image in prompt.images),
            prompt_token_ids=list(prompt.token_ids),
        )
        if params.prompt_logprobs is not None:
            output.prompt_logprobs = [None] * num_prompt
        detokenizer = IncrementalDetokenizer(self._detok_decoder, params.stop, params.min_tokens)
        # A constrained request ends on the EOS its grammar allows, even with ignore_eos.
        ignore_eos = params.ignore_eos and request.grammar is None
        stops = frozenset(params.stop_token_ids) | (
            frozenset() if ignore_eos else frozenset(self.eos_token_ids)
        )
        sampler = make_sampler(params, prompt.token_ids, stops, self._detok_tokenizer)
        sampler.grammar = request.grammar
        state = RequestState(
            seq, params, sampler, request.max_tokens, output, detokenizer, stops, prompt.works
        )
        self._states[request_id] = state
        # Its images may still be decoding in the pool (its grammar compiling): queued now,
        # admitted once ready.
        seq.ready = not pending_images(prompt.works) and request.grammar is None
        if request.share_prompt_with in self._states:  # held until that one's prefill is done
            self._held[request_id] = request.share_prompt_with
            seq.ready = False
        self.scheduler.add(seq, num_prompt + request.max_tokens)
        self.runner.add_request(request_id, prompt.works)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._states.get(request_id)
        if state is None:
            return None
        self._finish(state, "abort")
        return state.output

    def has_unfinished(self) -> bool:
        # A live request is always the scheduler's until it finishes, even while its last
        # token is in flight: a step in flight with none left has nothing to hand out.
        return self.scheduler.has_unfinished()

    # -- the loop ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: plan, run, sample, advance. Returns the outputs of requests that
        produced tokens or finished (failed ones included) in this step. With async
        scheduling a call launches the next step on the forward thread and returns the
        tokens of the step the call before launched, which ran meanwhile."""
        start, forward_cpu = time.thread_time(), self.times.forward_cpu_s
        outputs = self._step_sync() if self._forward is None else self._step_async()
        host = time.thread_time() - start
        if self._forward is None:  # the forward ran on this thread
            host -= self.times.forward_cpu_s - forward_cpu
        self.times.host_s += host
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        started = time.perf_counter()  # planning and the tower's work count in the step
        plan, failed = self._plan(idle_wait=True)
        if plan.is_empty:
            return failed
        states = [self._states[item.request_id] for item in plan.scheduled]
        try:
            wants, prompt_samplers = prompt_logit_requests(plan, self._states)
            inputs = self.runner.prepare(plan, None, wants)
            samplers = samplers_of(plan, states)
            sampled = run_step(
                self.runner, self.times, inputs, plan.scheduled, samplers, None, prompt_samplers
            )
            if self.step_cost is not None:
                shape = self.scheduler.step_shape(plan)
                self.step_cost.record(shape, time.perf_counter() - started)
        except Exception as e:  # noqa: BLE001 - belongs to no one request: fail the step's
            return failed + self._fail_step(states, e)
        accepted, failed_now = self._take(states, sampled)
        plan = plan.without({out.request_id for out in failed_now})
        self._count_prompt_work(plan.scheduled)
        self.scheduler.update(
            plan, [accepted.get(item.request_id, ([], None))[0] for item in plan.scheduled]
        )
        self.num_steps += 1
        return failed + failed_now + self._emit(accepted)

    def _step_async(self) -> list[RequestOutput]:
        """Plan and launch step i+1, then take step i's tokens: the forward of step i+1
        runs while they are checked, detokenised and booked (NanoFlow §4.2.1)."""
        previous, self._in_flight = self._in_flight, None
        plan, failed = self._plan(idle_wait=previous is None)
        if not plan.is_empty:
            self._in_flight = self._launch(plan, previous)
        return failed + self._collect(previous)

    def _plan(self, idle_wait: bool) -> tuple[StepPlan, list[RequestOutput]]:
        """The next plan, without the requests whose images failed (those come back
        failed). `idle_wait`: with nothing to run, wait briefly for a decoding image."""
        failed = self._poll_images()
        plan = self.scheduler.schedule()
        bm = self.scheduler.block_manager  # the KV high-water mark (n > 1 shares the prompt)
        used = bm.num_usable_blocks - bm.num_free_blocks
        self.peak_used_blocks = max(self.peak_used_blocks, used)
        # The runner forgets the finished, keeps the preempted's images, encodes the step's.
        image_failures = self.runner.begin_step(plan)
        if (stuck := self.scheduler.never_starts(plan)) is not None:  # a bug: fail, not spin
            failed.append(self._fail(self._states[stuck.request_id], NeverStartsError(stuck)))
        if plan.is_empty:
            if idle_wait and not failed:
                unready = [s for s in self._states.values() if not s.seq.ready]
                compiling = [s.sampler.grammar.future for s in unready if s.sampler.grammar]
                wait_for_images((s.works for s in unready), compiling)
            return plan, failed
        failed += [
            self._fail(self._states[request_id], error)
            for request_id, error in image_failures.items()
        ]
        return plan.without({out.request_id for out in failed}), failed

    def _launch(self, plan: StepPlan, previous: InFlightStep | None) -> InFlightStep:
        """Build `plan`'s inputs, count it as run (`advance`) and queue it on the forward
        thread. Its decodes of tokens `previous` is still sampling take them from its
        output there."""
        assert self._forward is not None
        states = [self._states[item.request_id] for item in plan.scheduled]
        in_flight = None
        if previous is not None:
            scheduled = previous.step.plan.scheduled
            in_flight = {item.request_id: i for i, item in enumerate(scheduled) if item.sample}
        future: futures.Future[Sampled] = futures.Future()
        try:
            wants, prompt_samplers = prompt_logit_requests(plan, self._states)
            inputs = self.runner.prepare(plan, in_flight, wants)
            samplers, before = samplers_of(plan, states), previous.future if previous else None
            future = self._forward.submit(inputs, plan.scheduled, samplers, before, prompt_samplers)
        except Exception as e:  # noqa: BLE001 - as the forward raising: fails when taken
            future.set_exception(e)
        return InFlightStep(self.scheduler.launch(plan), states, future)

    def _collect(self, flight: InFlightStep | None) -> list[RequestOutput]:
        """Wait for `flight`'s output and take it like a synchronous step's. Requests that
        finished since it was launched are skipped: their extra token is never emitted."""
        if flight is None:
            return []
        start = time.perf_counter()
        try:
            sampled = flight.future.result()
        except Exception as e:  # noqa: BLE001 - belongs to no one request: fail the step's
            return self._fail_step(flight.states, e)
        finally:
            self.times.wait_s += time.perf_counter() - start
        accepted, failed = self._take(flight.states, sampled)
        step = flight.step
        tokens = [accepted.get(item.request_id, ([], None))[0] for item in step.plan.scheduled]
        self._count_prompt_work(step.plan.scheduled)
        self.scheduler.land(step, tokens)
        self.num_steps += 1
        return failed + self._emit(accepted)

    def _take(
        self, states: list[RequestState], sampled: Sampled
    ) -> tuple[Kept, list[RequestOutput]]:
        """The tokens each request keeps (cut at its stop) and the requests whose
        sampling failed (failed alone). Requests finished meanwhile are left out."""
        accepted: Kept = {}
        failed = []
        for state, new in zip(states, sampled, strict=True):
            if state.seq.status == "finished":
                continue
            take_prompt_logprobs(state.sampler, state.output)
            if isinstance(new, RequestError):  # its constraint cannot go on: a 400
                failed.append(self._fail(state, new))
            elif isinstance(new, Exception):
                log.error("sampling failed for %s: %r", state.seq.request_id, new)
                failed.append(self._fail(state, StepFailedError(f"sampling failed: {new}")))
            elif new:
                accepted[state.seq.request_id] = kept = self._accept(state, new)
                take_logprobs(state.sampler, state.output, len(kept[0]))
        return accepted, failed

    def _emit(self, accepted: Kept) -> list[RequestOutput]:
        outputs = []
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

    def _fail_step(self, states: list[RequestState], error: Exception) -> list[RequestOutput]:
        """The forward failed: fail the step's requests (those not finished meanwhile)."""
        live = [state for state in states if state.seq.status != "finished"]
        log.error("forward pass failed; failing the %d requests in it", len(live), exc_info=error)
        return [self._fail(state, StepFailedError(str(error))) for state in live]

    def _poll_images(self) -> list[RequestOutput]:
        """Ready the sequences whose images are decoded and grammars compiled; fail those
        whose decode or compile failed. A held sibling (n > 1) is ready once the one it
        waits for has a token or ended."""
        for request_id, parent in list(self._held.items()):
            state = self._states.get(parent)
            if state is None or state.output.token_ids:
                del self._held[request_id]
        unready = {
            rid: s for rid, s in self._states.items() if not s.seq.ready and rid not in self._held
        }
        if not unready:
            return []
        compiling, failures = poll_grammars({r: s.sampler.grammar for r, s in unready.items()})
        works = {rid: s.works for rid, s in unready.items() if rid not in compiling}
        ready, image_failures = poll_images(works)
        for request_id in ready:
            self._states[request_id].seq.ready = True
        failures += image_failures
        return [self._fail(self._states[request_id], e) for request_id, e in failures]

    def _count_prompt_work(self, scheduled: list[ScheduledSeq]) -> None:
        """Prompt tokens the items computed, failed ones left out."""
        for item in scheduled:
            state = self._states.get(item.request_id)  # None: finished meanwhile
            if state is not None:
                prompt_end = min(item.end, state.seq.num_prompt_tokens)
                self.num_computed_prompt_tokens += max(0, prompt_end - item.num_computed_tokens)

    def _accept(self, state: RequestState, new: list[int]) -> tuple[list[int], FinishReason | None]:
        """`new` up to and including the first token that ends the request (a stop id, a
        completed stop string, max_tokens or the context), as plain decoding would stop:
        accepted drafts past it are dropped. Feeds the detokenizer token by token."""
        stops = state.stop_token_ids
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

    def _fail(self, state: RequestState, error: Exception) -> RequestOutput:
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

    def _finish(self, state: RequestState, reason: FinishReason) -> None:
        state.output.finished = True
        state.output.finish_reason = reason
        state.output.num_cached_tokens = state.seq.num_cached_tokens
        self.scheduler.finish(state.seq)  # the runner forgets it with the next plan
        self._held.pop(state.seq.request_id, None)
        del self._states[state.seq.request_id]

    def close(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel workers).
        Also done when the engine is garbage-collected or the interpreter exits."""
        self.grammars.close()
        self.runner.close()

    def stats(self) -> dict[str, float]:
        """Engine-side gauges and counters for metrics: queue, KV pool, prefix and encoder
        caches, preprocessing stage seconds, speculation."""
        stats = engine_stats(
            self.scheduler.stats(), self.num_steps, self.num_computed_prompt_tokens,
            self.runner.encoder_cache.stats(), self.processor.pool_metrics(), self.spec_metrics,
        )  # fmt: skip
        return stats | {"peak_used_blocks": float(self.peak_used_blocks)}

    @property
    def spec_metrics(self) -> SpecMetrics | None:
        """Speculation counters (proposed, accepted, mean accepted length); None when off."""
        return self.scheduler.spec_metrics

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run `requests` to completion. A request that cannot be served gets an output
        with `error` set; the others are unaffected. A request with n > 1 gives n outputs
        in a row (best_of: the n of highest cumulative logprob, best first)."""
        return generate_all(self, requests)

"""The engine loop: requests in, tokens out.

`add_request` validates and tokenises, `step` runs one scheduler plan through the model
and returns what each touched request produced, `generate` drives both to completion.
The HTTP server drives the same `add_request / step` loop from its own thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from encoders.errors import PromptTooLongError, RequestError
from scheduler.planner import Scheduler, StepPlan
from scheduler.sequence import Sequence
from scheduler.spec_policy import SpecMetrics
from vlmserve.config import EngineConfig
from vlmserve.processing import ProcessedPrompt, Request, make_prompt_processor
from vlmserve.runner import ModelRunner
from vlmserve.sampling import SamplerState, SamplingParams
from vlmserve.spec_decode import ridge_batch_for, sample_plan

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)  # since the previous step
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
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
        context = model.decoder.cfg.max_position_embeddings
        self.max_model_len = min(config.model.max_model_len or context, context)
        speculative = config.speculative
        if speculative.enabled and speculative.adaptive and speculative.ridge_batch is None:
            ridge = ridge_batch_for(self.runner.device, self.runner.dtype)
            speculative = dataclasses.replace(speculative, ridge_batch=ridge)
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.runner.num_blocks, speculative=speculative
        )
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
        prompt = self.processor.process(request)
        num_prompt = len(prompt.token_ids)
        if num_prompt >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {num_prompt} tokens, the model's context is {self.max_model_len} "
                "tokens (and at least one must be left to generate)"
            )
        max_tokens = min(params.max_tokens, self.max_model_len - num_prompt)
        self._check_fits(num_prompt, max_tokens)
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
        state = _State(seq, params, SamplerState(params), request.max_tokens, output)
        self._states[request_id] = state
        self.scheduler.add(seq, num_prompt + request.max_tokens)
        return request_id

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        block_manager = self.scheduler.block_manager
        needed = block_manager.blocks_for(num_prompt + max_tokens)
        if needed > block_manager.num_blocks:
            raise RequestError(
                f"request needs {needed} KV blocks ({num_prompt} prompt + {max_tokens} "
                f"output tokens), the KV pool holds {block_manager.num_blocks}"
            )
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and num_prompt > sched.max_num_batched_tokens:
            raise PromptTooLongError(
                f"prompt is {num_prompt} tokens, over max_num_batched_tokens="
                f"{sched.max_num_batched_tokens} with chunked prefill off"
            )

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
        produced tokens or finished in this step."""
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self.runner.release(seq.request_id)
        if plan.is_empty:
            return []
        logits = self.runner.execute(plan)
        rows = [self._states[item.seq.request_id].sampler for item in plan.scheduled if item.sample]
        sampled = sample_plan(plan.scheduled, logits, rows)
        for i, new in enumerate(sampled):
            if len(new) > 1:  # accepted drafts: nothing past the token that ends the request
                sampled[i] = self._cut_at_stop(self._states[plan.scheduled[i].seq.request_id], new)
        self._count_prompt_work(plan)
        self.scheduler.update(plan, sampled)
        self.num_steps += 1
        outputs = []
        for item, new in zip(plan.scheduled, sampled, strict=True):
            if new:
                state = self._states[item.seq.request_id]
                self._append(state, new)
                outputs.append(state.output)
        return outputs

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

    def _cut_at_stop(self, state: _State, new: list[int]) -> list[int]:
        """`new` up to and including the first token that would end the request (a stop
        id, max_tokens, or a completed stop string), as plain decoding would stop."""
        params, done = state.params, state.output.token_ids
        stops = self._stop_token_ids(params)
        for i, token in enumerate(new[:-1]):
            # max_tokens already caps by the context (see add_request).
            if token in stops or len(done) + i + 1 >= state.max_tokens:
                return new[: i + 1]
            if params.stop:
                text = self.tokenizer.decode(done + new[: i + 1], skip_special_tokens=True)
                if any(stop in text for stop in params.stop):
                    return new[: i + 1]
        return new

    def _append(self, state: _State, new: list[int]) -> None:
        out, params = state.output, state.params
        out.new_token_ids = list(new)
        out.token_ids.extend(new)
        reason: FinishReason | None = None
        stops = self._stop_token_ids(params)
        if new[-1] in stops:
            reason = "stop"
        out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        for stop in params.stop:
            cut = out.text.find(stop)
            if cut >= 0:
                out.text, reason = out.text[:cut], "stop"
        if reason is None and (
            len(out.token_ids) >= state.max_tokens or state.seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self._finish(state, reason)

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
            stats |= {"spec_proposed": float(spec.proposed), "spec_accepted": float(spec.accepted)}
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

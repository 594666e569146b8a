"""Warm-up before serving: a few requests through the engine that meet the step shapes
live traffic will, so the first real requests do not pay for them; and, first, everything a
request's path would otherwise build on its first use.

Nothing a request needs is built on its first use (issue 41: a deep copy of a
262,144-token tokenizer takes 2 s and holds the GIL; xgrammar's tables for it, seconds):
the prompt processor's copies (`warm`: the tokenizer's where it has no thread-safe encode
path, the HF processor's where images take that path) and the grammar compiler with its
tokenizer tables are made first, every part timed in the log line. They are never skipped
and not counted against `max_seconds`, which bounds the engine-step phases only.

On a CPU, oneDNN builds (JIT-compiles) a GEMM primitive the first time it meets a shape,
the C++ kernels and the allocator meet their first buffers, and the vision tower its first
tile batch: the first requests after start ran at about half speed until they had all been
met (issue 29; vLLM spends its start-up warming and compiling). The warm-up runs, in this
order, while time is left of `max_seconds` (a phase started is finished):
- on a CPU, each distinct packed linear of the decoder (oneDNN) at every row count a
  decode step can have, 1 to max_num_seqs: oneDNN builds a primitive per row count the
  first time (1-3 ms a shape on a Zen 5), and the decode batch size changes step by step
  as requests come and go; plain GEMMs on zeros, no engine steps, a quarter of the time
  bound at most (1.7 s of one thread for the 100M Llama at 64 sequences);
- one sampled request (temperature, top-k/p, logprobs, a grammar): the sampler's kernels,
  which load on first use;
- one prefill chunk of the full step budget (max_num_batched_tokens, at most 2,048 tokens
  and the context);
- decode batches of 1, 2, 4, ... up to max_num_seqs sequences (each bucket's prefill of
  short prompts, then decode steps at that batch);
- for a vision model, one small and one large image (the fewest and the most tiles).
The outputs are thrown away; the KV blocks go back to the pool (as cached prefixes no
real prompt shares) and the engine's counters include the warm-up's steps.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from kernels.packed_linear import PackedLinear
from vlmserve.config import EngineConfig
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.sample.structured import StructuredOutput

log = logging.getLogger(__name__)

DEFAULT_MAX_SECONDS = 20.0
_SHORT_PROMPT = 8  # tokens of each decode-bucket request (under a block: never cached)
_MAX_CHUNK = 2048  # the prefill phase's cap (a larger budget's chunks: met live)
_IMAGE_SIZES = ((48, 48), (1536, 1024))  # the fewest and (capped by the tiling) most tiles


class Engine(Protocol):
    """What the warm-up uses of the Engine (vlmserve/engine/core.py, which calls it: a
    protocol here, not an import back)."""

    config: EngineConfig
    tokenizer: Any
    eos_token_ids: Any
    max_model_len: int
    runner: Any
    num_steps: int
    processor: Any  # its `warm()`: the copies it makes, in seconds by name
    grammars: Any  # vlmserve.engine.grammars.LazyGrammars

    def has_unfinished(self) -> bool: ...

    def generate(self, requests: list[Request]) -> list: ...


@dataclass
class WarmupReport:
    """What the warm-up ran: its phases, steps and seconds."""

    seconds: float = 0.0
    num_steps: int = 0
    phases: list[str] = field(default_factory=list)
    phase_seconds: list[float] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # out of time

    def summary(self) -> str:
        timed = zip(self.phases, self.phase_seconds, strict=True)
        done = ", ".join(f"{name} {s:.1f} s" for name, s in timed) or "nothing"
        left = f"; skipped (time bound): {', '.join(self.skipped)}" if self.skipped else ""
        return f"warm-up done in {self.seconds:.1f} s, {self.num_steps} steps: {done}{left}"


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


def warm_up(engine: Engine, max_seconds: float = DEFAULT_MAX_SECONDS) -> WarmupReport:
    """Run the phases (module doc) through `engine` while time is left; log and return
    what ran. The engine must be idle."""
    assert not engine.has_unfinished(), "warm up an idle engine"
    report, start = WarmupReport(), time.perf_counter()
    for name, seconds in warm_request_path(engine).items():
        report.phases.append(name)
        report.phase_seconds.append(seconds)
    steps_start = time.perf_counter()  # the bound is the engine steps'
    steps_before = engine.num_steps
    for name, work in _phases(engine, max_seconds):
        if time.perf_counter() - steps_start > max_seconds:
            report.skipped.append(name)
            continue
        phase_start = time.perf_counter()
        work()
        report.phases.append(name)
        report.phase_seconds.append(time.perf_counter() - phase_start)
    report.seconds = time.perf_counter() - start
    report.num_steps = engine.num_steps - steps_before
    log.info("%s", report.summary())
    return report


def warm_request_path(engine: Engine) -> dict[str, float]:
    """Build what a request's path would build on first use (module doc): seconds by part."""
    warm = getattr(engine.processor, "warm", None)
    made = dict(warm()) if warm is not None else {}
    start = time.perf_counter()
    engine.grammars.warm()
    made["grammar tables"] = time.perf_counter() - start
    return made


def warm_linears(decoder: torch.nn.Module, max_rows: int, max_seconds: float) -> int:
    """Each distinct packed linear under `decoder` once at row counts 1, 2, ... max_rows
    (on zeros; the outputs dropped) until `max_seconds` have passed; returns the most rows
    reached."""
    layers: dict[tuple, PackedLinear] = {}
    for module in decoder.modules():
        if isinstance(module, PackedLinear):
            key = (module.in_features, module.out_features, module.bias is None)
            layers.setdefault(key, module)
    dtype = decoder.dtype
    deadline = time.perf_counter() + max_seconds
    rows = 0
    with torch.inference_mode():
        while rows < max_rows and time.perf_counter() < deadline:
            rows += 1
            for layer in layers.values():
                layer(torch.zeros(rows, layer.in_features, dtype=dtype))
    return rows


def _phases(engine: Engine, max_seconds: float) -> Iterator[tuple[str, Callable[[], object]]]:
    """(name, its work) per phase, built lazily (in phase order)."""
    sched = engine.config.scheduler
    decoder = getattr(getattr(engine.runner, "model", None), "decoder", None)
    if decoder is not None and engine.config.model.device == "cpu":
        # a quarter of the bound at most (a large max_num_seqs: the smaller batches first)
        yield (
            f"linears x1-{sched.max_num_seqs}",
            functools.partial(warm_linears, decoder, sched.max_num_seqs, max_seconds / 4),
        )
    for name, requests in _request_phases(engine):
        yield name, functools.partial(engine.generate, requests)


def _request_phases(engine: Engine) -> Iterator[tuple[str, list[Request]]]:
    """(name, requests) per engine phase, built lazily (in phase order)."""
    sched = engine.config.scheduler
    ids = engine.tokenizer("describe the picture please", add_special_tokens=False).input_ids
    ids = [i for i in ids if i not in engine.eos_token_ids] or [0]

    def prompt(length: int) -> list[int]:
        return (ids * (length // len(ids) + 1))[:length]

    def params(tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    # First (cheap; the time bound must not skip it): the sampler's other paths, whose C++
    # kernels load on first use: temperature, top-k/p, logprobs, a grammar's mask (a
    # choice of one token's text: any tokenizer writes it).
    text = engine.tokenizer.decode(ids[:1])
    structured = StructuredOutput.choice([text]) if text.strip() else None
    sampled = SamplingParams(max_tokens=2, temperature=1.0, top_k=20, top_p=0.9, seed=0,
                             logprobs=2, structured=structured)  # fmt: skip
    yield "sampled", [Request(prompt_token_ids=prompt(_SHORT_PROMPT), sampling=sampled)]
    chunk = min(sched.max_num_batched_tokens, engine.max_model_len - 4, _MAX_CHUNK)
    yield f"prefill {chunk}", [Request(prompt_token_ids=prompt(chunk), sampling=params(2))]
    for b in decode_buckets(sched.max_num_seqs):
        yield (
            f"decode x{b}",
            [Request(prompt_token_ids=prompt(_SHORT_PROMPT), sampling=params(4)) for i in range(b)],
        )
    if engine.runner.model.vision is None:
        return
    rng = np.random.default_rng(0)
    for width, height in _IMAGE_SIZES:
        pixels = rng.integers(1, 255, (height, width, 3), dtype=np.uint8)
        content = [{"type": "image", "image": Image.fromarray(pixels)},
                   {"type": "text", "text": "describe"}]  # fmt: skip
        request = Request(messages=[{"role": "user", "content": content}], sampling=params(2))
        yield f"image {width}x{height}", [request]

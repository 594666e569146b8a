"""Trace simulator: the real scheduler (scheduler/) on simulated time.

Each request of a trace arrives, is refused if it can never fit (as the engine answers
400), has its images preprocessed by a pool of CPU workers, and is then scheduled by
`scheduler.planner.Scheduler` itself: no copy of the policy lives here. Every step's
plan is priced by `search.sim.step_time` (ViT tiles of encoder-cache misses, prefill rows,
decode rows, KV read) and the clock advances by that much. Out come per-request TTFT /
TPOT / end-to-end times, preemptions, recomputed tokens and KV occupancy over time.

What is modelled: chunked prefill, prefix caching (image positions hash by content),
preemption by recomputation, an encoder-output LRU, CPU preprocessing as a queue, and a
server's fixed per-request latency on each side of the engine (`ingress_s`: HTTP parse,
chat template, tokenisation, the hand-off to the engine thread, and `ingress_s_per_image`
more per image: its upload's decode, header, hash and the pool's round trip beyond its
busy time; `egress_s`: from the sampled token to the client), 0 unless measured.
What is not: sampling (every output runs to `max_tokens`), speculation, host overheads
beyond `step_overhead_s` (or what a `MeasuredStepCost` fitted to the real engine holds),
tensor parallelism, network and detokenisation time.
"""

from __future__ import annotations

import dataclasses
import heapq
import inspect
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler.config import CacheConfig, SchedulerConfig, SloConfig
from scheduler.lump_budget import StepShape
from scheduler.planner import Scheduler
from scheduler.sequence import ImagePlaceholder, Sequence
from scheduler.step_plan import StepPlan
from search.image_budget import visual_tokens
from search.sim.step_time import (
    StepHardware,
    StepWork,
    count_work,
    kv_pool_blocks,
    kv_windows,
    sliding_window_of,
    step_time,
)
from search.sim.traces import TraceRequest

IMAGE_TOKEN_ID = 0  # every placeholder shares one id; its key is (content hash, offset)
_SEQ_FIELDS = {f.name for f in dataclasses.fields(Sequence)}
_IMAGE_FIELDS = {f.name for f in dataclasses.fields(ImagePlaceholder)}


@dataclass(frozen=True)
class SimConfig:
    admission: str = "fcfs"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    # Extra SchedulerConfig fields (max_wait_steps, encoder_tiles_per_step, …), passed on
    # only when this checkout's SchedulerConfig has them.
    scheduler_options: tuple[tuple[str, Any], ...] = ()
    pooling_ratio: int = 4
    preprocess_workers: int = 8
    encoder_cache_bytes: float = 4e9
    max_sim_s: float = 3600.0  # a run still busy at this simulated time counts as a hang
    kv_timeline_points: int = 2000
    # KV pool in blocks; None: what fits beside the weights on the hardware (kv_pool_blocks).
    num_blocks: int | None = None
    # Seconds from a request's arrival until the scheduler holds it (its preprocessing
    # starts then too), and from a sampled token until the client has it.
    ingress_s: float = 0.0
    ingress_s_per_image: float = 0.0
    egress_s: float = 0.0
    # The latency targets the scheduler plans against (lumpy: slack order, TPOT guard
    # priced by this run's step-time model); the default: none, as the engine's.
    slo: SloConfig = SloConfig()

    def __post_init__(self) -> None:
        if min(self.ingress_s, self.ingress_s_per_image, self.egress_s) < 0:
            raise ValueError(
                f"ingress_s={self.ingress_s}, ingress_s_per_image={self.ingress_s_per_image} "
                f"and egress_s={self.egress_s} must be >= 0"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1 (or None)")
        if self.preprocess_workers < 1 or self.pooling_ratio < 1:
            raise ValueError("preprocess_workers and pooling_ratio must be >= 1")
        if self.max_sim_s <= 0:
            raise ValueError(f"max_sim_s={self.max_sim_s} must be > 0")


@dataclass
class RequestRecord:
    request_id: str
    request_class: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    refused: str | None = None  # why it was refused at arrival
    ready_s: float | None = None  # its images preprocessed: the scheduler may start it
    start_s: float | None = None  # the start of the first step that scheduled it
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_images: int = 0  # its class for SLO purposes: text (none) or image
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache when admitted

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass
class SimResult:
    records: list[RequestRecord]
    num_blocks: int
    num_steps: int
    end_s: float
    num_preemptions: int
    num_recomputed_tokens: int
    num_tiles_encoded: int
    hang: bool
    # (time s, fraction of KV blocks held by live sequences, requests waiting or preparing)
    timeline: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def num_lost(self) -> int:
        """Admitted (not refused) requests that never finished."""
        return sum(1 for r in self.records if r.refused is None and r.finish_s is None)


class EncoderCacheModel:
    """The encoder-output cache as the simulator sees it: an LRU of content hashes under
    a byte budget (pooled embeddings, visual tokens × hidden × 2 bytes)."""

    def __init__(self, capacity_bytes: float) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, float] = OrderedDict()
        self._bytes = 0.0

    def contains(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def insert(self, content_hash: bytes, num_bytes: float) -> None:
        if content_hash in self._entries:
            self._entries.move_to_end(content_hash)
            return
        if num_bytes > self.capacity_bytes:
            return
        self._entries[content_hash] = num_bytes
        self._bytes += num_bytes
        while self._bytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted


def build_scheduler(
    config: SimConfig,
    num_blocks: int,
    encoder_cache: EncoderCacheModel,
    hw: StepHardware | None = None,
    clock: Callable[[], float] | None = None,
) -> Scheduler:
    """The engine's scheduler for `config`; options this checkout lacks are refused. With
    `hw` and `clock` it gets the step-time model and the simulated clock (SLO planning)."""
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    options = dict(config.scheduler_options)
    if config.slo != SloConfig():
        options.setdefault("slo", config.slo)
    if "admission" in known:
        options["admission"] = config.admission
    elif config.admission != "fcfs":
        raise ValueError(f"this scheduler has no {config.admission!r} admission (only fcfs)")
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"SchedulerConfig has no {', '.join(unknown)}")
    sched = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        **options,
    )
    cache = CacheConfig(
        block_size=config.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        watermark=config.watermark,
    )
    extra: dict[str, Any] = {}
    params = inspect.signature(Scheduler).parameters
    if "encoder_cached" in params:
        extra["encoder_cached"] = encoder_cache.contains
    if hw is not None and clock is not None and "step_cost" in params:
        extra["step_cost"], extra["clock"] = step_cost_of(hw), clock
    if hw is not None and "kv_windows" in params:  # hybrid KV: each group's real cost
        extra["kv_windows"] = kv_windows(hw.model)
    return Scheduler(sched, cache, num_blocks, **extra)


def step_cost_of(hw: StepHardware) -> Callable[[StepShape], float]:
    """The scheduler's step-cost model on `hw`: this module's own pricing of a step (a
    `StepShape` has `StepWork`'s fields, the sliding window's counts included)."""
    return lambda shape: step_time(StepWork(*shape), hw).total_s


def refusal(
    scheduler: Scheduler, num_prompt_tokens: int, max_tokens: int, watermark: float
) -> str | None:
    """Why a request can never run (the engine's 400), or None."""
    check = getattr(scheduler, "check_fits", None)
    if check is not None:
        return check(num_prompt_tokens, max_tokens)
    bm = scheduler.block_manager
    usable = bm.num_blocks - int(bm.num_blocks * watermark)
    needed = bm.blocks_for(num_prompt_tokens + max_tokens)
    if needed > usable:
        return f"needs {needed} KV blocks, the pool admits at most {usable}"
    return None


def make_sequence(req: TraceRequest, hw: StepHardware, pooling_ratio: int, index: int) -> Sequence:
    """Token layout: shared system prompt, the images' placeholders, then the user text.
    Text ids are unique to the request (`index`) so only the system prompt and images
    are shared."""
    sid = req.system_prompt_id  # 0: the shared prompt; others their own (negative) ids
    ids = [
        1 + (i % 997) if sid == 0 else -(sid << 32) - i - 1 for i in range(req.num_system_tokens)
    ]
    images = []
    for im in req.images:
        n = visual_tokens(im.num_tiles * hw.encoder.tokens_per_tile, pooling_ratio)
        img = ImagePlaceholder(im.content_hash.encode(), list(range(len(ids), len(ids) + n)))
        if "num_tiles" in _IMAGE_FIELDS:
            img.num_tiles = im.num_tiles
        images.append(img)
        ids += [IMAGE_TOKEN_ID] * n
    base = 1000 + index * 1_000_003  # one id range per request: no false prefix hits
    if req.session_id is not None:  # one range per conversation: turns share their text
        base = -(1 << 62) + (zlib.crc32(req.session_id.encode()) << 24)
    ids += [base + i for i in range(req.num_text_tokens)]
    return Sequence(req.request_id, ids, images)


class _Sim:
    """The loop's state; `simulate` is the entry point."""

    def __init__(self, trace: list[TraceRequest], hw: StepHardware, config: SimConfig) -> None:
        self.hw, self.config = hw, config
        self.trace = sorted(trace, key=lambda r: r.arrival_s)
        self.num_blocks = config.num_blocks or kv_pool_blocks(hw, config.block_size)
        self.encoder_cache = EncoderCacheModel(config.encoder_cache_bytes)
        self.scheduler = build_scheduler(
            config, self.num_blocks, self.encoder_cache, hw, lambda: self.now
        )
        self.honours_ready = "ready" in _SEQ_FIELDS
        self.workers = [0.0] * config.preprocess_workers  # when each CPU worker is next free
        self.preparing: list[tuple[float, int, Sequence]] = []  # heap by ready time
        self.records: dict[str, RequestRecord] = {}
        self.max_tokens: dict[str, int] = {}
        self.encoded: dict[str, set[bytes]] = {}  # images whose embeddings this pass has
        self.now = 0.0
        self.num_recomputed = self.num_tiles = self.num_steps = 0
        self.timeline: list[tuple[float, float, int]] = []

    def image_bytes(self, img: ImagePlaceholder) -> float:
        return img.num_tokens * self.hw.model.hidden_size * 2.0

    def arrive(self, req: TraceRequest) -> None:
        seq = make_sequence(req, self.hw, self.config.pooling_ratio, len(self.records))
        if "arrival_time" in _SEQ_FIELDS:  # its TTFT counts from the client's send
            seq.arrival_time = req.arrival_s
        rec = RequestRecord(
            req.request_id,
            req.request_class,
            req.arrival_s,
            seq.num_prompt_tokens,
            req.max_tokens,
            num_images=len(req.images),
        )
        self.records[req.request_id] = rec
        rec.refused = refusal(
            self.scheduler, seq.num_prompt_tokens, req.max_tokens, self.config.watermark
        )
        if rec.refused is not None:
            return
        # CPU preprocessing (decode, resize, crop) of each image not already encoded.
        ready_at = held_at = self.held_at(req)
        per_tile = self.hw.assumptions.preprocess_s_per_tile
        for im, img in zip(req.images, seq.images, strict=True):
            if self.encoder_cache.contains(img.content_hash):
                continue
            w = min(range(len(self.workers)), key=self.workers.__getitem__)
            self.workers[w] = max(self.workers[w], held_at) + im.num_tiles * per_tile
            ready_at = max(ready_at, self.workers[w])
        self.max_tokens[seq.request_id] = req.max_tokens
        self.encoded[seq.request_id] = set()
        rec.ready_s = ready_at
        seq.ready = ready_at <= self.now
        if self.honours_ready or seq.ready:
            self.scheduler.add(seq, seq.num_prompt_tokens + req.max_tokens)
        if not seq.ready:
            heapq.heappush(self.preparing, (ready_at, len(self.records), seq))

    def held_at(self, req: TraceRequest) -> float:
        """When the scheduler gets `req`: its arrival plus the server's ingress latency."""
        per_image = self.config.ingress_s_per_image
        return req.arrival_s + self.config.ingress_s + len(req.images) * per_image

    def release(self) -> None:
        """Arrivals and finished preprocessing up to `now`."""
        while self.pending and self.held_at(self.pending[-1]) <= self.now:
            self.arrive(self.pending.pop())
        while self.preparing and self.preparing[0][0] <= self.now:
            _, _, seq = heapq.heappop(self.preparing)
            seq.ready = True
            if not self.honours_ready:
                self.scheduler.add(seq, seq.num_prompt_tokens + self.max_tokens[seq.request_id])

    def next_event(self) -> float | None:
        times = [self.held_at(self.pending[-1])] if self.pending else []
        if self.preparing:
            times.append(self.preparing[0][0])
        return min(times) if times else None

    def price(self, plan: StepPlan) -> StepWork:
        chunks, tiles = [], 0
        for item in plan.scheduled:
            seq, n = self.scheduler.seqs[item.request_id], item.num_new_tokens
            start = item.num_computed_tokens
            chunks.append((start, n, n == 1 and start >= seq.num_prompt_tokens))
            done = self.encoded[seq.request_id]
            for img in seq.images:
                if img.content_hash in done or not (
                    img.positions[0] < start + n and img.positions[-1] >= start
                ):
                    continue
                if not self.encoder_cache.contains(img.content_hash):
                    tiles += getattr(img, "num_tiles", 0) or self._tiles_of(img)
                self.encoder_cache.insert(img.content_hash, self.image_bytes(img))
                done.add(img.content_hash)
        return count_work(chunks, tiles, sliding_window_of(self.hw.model))

    def _tiles_of(self, img: ImagePlaceholder) -> int:
        # Before ImagePlaceholder.num_tiles exists: invert visual_tokens (exact for presets).
        per_tile = self.hw.encoder.tokens_per_tile / self.config.pooling_ratio
        return max(1, math.floor(img.num_tokens / per_tile))

    def step(self, plan: StepPlan) -> None:
        for request_id in plan.preempted:
            self.encoded[request_id].clear()
        for item in plan.scheduled:
            rec = self.records[item.request_id]
            rec.start_s = self.now if rec.start_s is None else rec.start_s
        work = self.price(plan)
        self.now += step_time(work, self.hw).total_s
        self.num_tiles += work.num_tiles_encoded
        self.num_steps += 1
        sampled = [[1] if item.sample else [] for item in plan.scheduled]
        self.scheduler.update(plan, sampled)
        for item, tokens in zip(plan.scheduled, sampled, strict=True):
            if not tokens:
                continue
            seq = self.scheduler.seqs[item.request_id]
            rec = self.records[seq.request_id]
            if rec.first_token_s is None:
                rec.first_token_s = self.now + self.config.egress_s
                rec.num_cached_tokens = seq.num_cached_tokens
            rec.num_output_tokens = seq.num_output_tokens
            if seq.num_output_tokens >= self.max_tokens[seq.request_id]:
                rec.finish_s = self.now + self.config.egress_s
                rec.num_preemptions = seq.num_preemptions
                self.scheduler.finish(seq)
                del self.encoded[seq.request_id]

    def run(self) -> SimResult:
        self.pending = list(reversed(self.trace))
        return self.result(self.advance(math.inf))

    def advance(self, until: float) -> bool:
        """Step until the clock reaches `until` (or, for inf, until nothing is left);
        True when the run hangs. Idle time before `until` is skipped."""
        while True:
            self.release()
            if self.now > self.config.max_sim_s:
                return self.scheduler.has_unfinished() or bool(self.preparing or self.pending)
            if self.now >= until:
                return False
            running = {s.request_id: s.num_computed_tokens for s in self.scheduler.running}
            plan = self.scheduler.schedule() if self.scheduler.has_unfinished() else None
            if plan is None or plan.is_empty:
                nxt = self.next_event()
                if nxt is None and until == math.inf:  # done, or stuck for good
                    return self.scheduler.has_unfinished()
                self.now = max(self.now, until if nxt is None else min(nxt, until))
                continue
            self.num_recomputed += sum(running.get(request_id, 0) for request_id in plan.preempted)
            self.step(plan)
            self.sample_timeline()

    def result(self, hang: bool) -> SimResult:
        counted = getattr(self.scheduler, "num_recomputed_tokens", None)
        return SimResult(
            records=list(self.records.values()),
            num_blocks=self.num_blocks,
            num_steps=self.num_steps,
            end_s=self.now,
            num_preemptions=self.scheduler.num_preemptions,
            num_recomputed_tokens=self.num_recomputed if counted is None else counted,
            num_tiles_encoded=self.num_tiles,
            hang=hang,
            timeline=_thin(self.timeline, self.config.kv_timeline_points),
        )

    def sample_timeline(self) -> None:
        bm = self.scheduler.block_manager
        usable = getattr(bm, "num_usable_blocks", bm.num_blocks)  # less a hybrid's null block
        used = usable - bm.num_free_blocks  # held by live sequences
        queued = len(self.scheduler.waiting) + (0 if self.honours_ready else len(self.preparing))
        self.timeline.append((self.now, used / usable, queued))


def _thin(points: list, limit: int) -> list:
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def simulate(
    trace: list[TraceRequest], hw: StepHardware, config: SimConfig = SimConfig()
) -> SimResult:
    """Run `trace` through the scheduler on `hw`'s simulated clock."""
    if not trace:
        raise ValueError("the trace holds no requests")
    return _Sim(trace, hw, config).run()

"""Configs of the CPU-side policy: the KV cache geometry (KV cache groups of a hybrid
model, their peak blocks per sequence) and the step planner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

AdmissionKind = Literal["fcfs", "lumpy"]
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
RequestClass = Literal["text", "image"]  # by whether the request carries images


def request_class(num_images: int) -> RequestClass:
    return "image" if num_images else "text"


@dataclass(frozen=True)
class SloConfig:
    """Latency targets the scheduler plans against (lumpy admission) and reports count
    against: time to first token per request class, and time per output token. None: no
    target. Shared by the engine (`--slo-ttft-ms`, `--slo-tpot-ms`) and the simulator."""

    ttft_s: float | None = None  # text requests' TTFT target (and images' unless set)
    tpot_s: float | None = None
    image_ttft_s: float | None = None  # None: the same as `ttft_s`

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "image_ttft_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name}={value} must be > 0 (or None)")

    def ttft_for(self, cls: RequestClass) -> float | None:
        if cls == "image" and self.image_ttft_s is not None:
            return self.image_ttft_s
        return self.ttft_s


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: the runner sizes the pool from `memory_bytes` (CPU) or free device memory.
    num_blocks: int | None = None
    memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    # Admission keeps this fraction of the pool free for running sequences to grow into.
    watermark: float = 0.01
    # The cache's element type, independent of the weights': "auto" = the model's dtype.
    # bfloat16 halves the KV bytes per token (twice the sequences per pool); the CPU
    # kernels read it with float32 softmax and accumulation.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark} must be in [0, 1)")


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per sequence."""

    sliding_window: int | None  # None: full attention
    layers: tuple[int, ...]


def kv_cache_groups(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """Layers grouped by attention kind (their window), every group as many layers as the
    rarest kind has, so a block (the KV of that many layers) fits any group. Full groups
    first. One kind: one group of every layer (today's single table). A kind whose count
    is no multiple of the group size gets one smaller last group; its blocks leave the
    missing layers' share of the block unused."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) <= 1:
        window = next(iter(kinds), None)
        return (KVCacheGroup(window, tuple(range(len(layer_windows)))),)
    size = min(len(layers) for layers in kinds.values())
    groups = []
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[window]
        groups += [
            KVCacheGroup(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size)
        ]
    return tuple(groups)


def group_peak_blocks(
    window: int | None, block_size: int, num_tokens: int, max_step_tokens: int | None
) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once in a group: all of
    them in a full group; in a sliding one the window before a step's first query (the
    blocks before it are released) plus the step's own tokens, at most
    ceil((window - 1 + step) / block_size) + 1 (+ 1: the window may start mid-block)."""
    blocks = -(-num_tokens // block_size)
    if window is None:
        return blocks
    step = num_tokens if max_step_tokens is None else min(max_step_tokens, num_tokens)
    return min(blocks, -(-(window - 1 + step) // block_size) + 1)


def seq_peak_blocks(
    windows: Sequence[int | None], block_size: int, num_tokens: int, max_step_tokens: int | None
) -> int:
    """`group_peak_blocks` over every group: what a sequence costs the shared pool."""
    return sum(group_peak_blocks(w, block_size, num_tokens, max_step_tokens) for w in windows)


def kv_pool_num_blocks(
    budget_bytes: int,
    block_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    blocks_per_seq: int | None = None,
) -> int:
    """Blocks of a KV pool sized by a byte budget: as many as `budget_bytes` holds, but no
    more than `max_num_seqs` sequences of `max_model_len` tokens fill at once (a bigger pool
    only ever holds prefix-cache leftovers). At least one block. `blocks_per_seq`: what one
    such sequence holds at most (hybrid KV: over every group, `kv_blocks.seq_peak_blocks`;
    default: a block per block_size tokens)."""
    assert block_bytes > 0 and block_size > 0, (block_bytes, block_size)
    if blocks_per_seq is None:
        blocks_per_seq = -(-max_model_len // block_size)  # ceil: a partial last block
    return max(1, min(budget_bytes // block_bytes, max_num_seqs * blocks_per_seq))


@dataclass(frozen=True)
class SchedulerConfig:
    # The dense token budget of one step (B_dense, NanoFlow §4.2): decodes first, then
    # prefill chunks fill the rest.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # "fcfs": arrival order, whole-prompt reservation, newest running sequence preempted
    # (the baseline). "lumpy" (article §17, "cache pressure arrives in lumps"): reserve
    # prompt + expected decode growth, quick requests first with an aging bound, the
    # victim is the sequence whose preemption wastes the least recompute (§19).
    admission: AdmissionKind = "lumpy"
    # Aging bound, in scheduler steps: a ready request that has waited this long goes
    # ahead of every later arrival and, until it fits, no later arrival is admitted.
    # 32 steps is ~0.3-1 s at 10-30 ms a step: long enough for a burst of quick requests
    # (cached images, short text) to pass a cold 13-tile image, short enough that the
    # image's TTFT grows by at most about one prefill of itself.
    max_wait_steps: int = 32
    # Vision-tower tiles encoded per step; None: unlimited. One so400m tile is ~0.65
    # TFLOP (search.image_budget.vit_flops) = ~1.3 ms on an H100 at 50% MFU; a 7B decode
    # step reads 15 GB of weights = ~4.5 ms. 8 tiles keep the tower to about two decode
    # steps' time, so a 13-tile image (which then goes alone) cannot stall every decode
    # for long, and most 1-6 tile images still batch together.
    encoder_tiles_per_step: int | None = 8
    # Decode growth reserved at admission per request: min(max_tokens, this). Clients
    # often send max_tokens = the whole context; reserving it all would admit a handful
    # of requests. VLM answers and captions are mostly under 256 tokens (16 blocks of
    # 16), so the reservation covers the typical request, and a longer one grows into the
    # watermark and, past it, is preempted at the least recompute.
    decode_reserve_tokens: int = 256
    # Lumpy only. Share of the KV pool a non-quick request (tower work, or a prefill over
    # one step) must leave free for quick ones: a burst of lumps larger than the pool
    # then cannot take every block and hold text requests out until it has decoded.
    # In the lumpy_admission benchmark (a burst of 4x13-tile requests, 3.2x the pool)
    # 0.1 still lets the burst fill the pool; 0.2 and 0.3 free it at 10 text req/s, and
    # only 0.3 at 20 req/s (text p99 TTFT 8.9x vs 2.4x unloaded).
    lump_headroom: float = 0.3
    # Lumpy only, with chunked prefill. Prefill tokens a step gives non-quick sequences
    # while a quick request is running or ready to start (with none, the whole budget);
    # None: the whole step budget always. Prefill is compute-bound from a few hundred
    # rows, so a small cap costs the lump little throughput and keeps every step short.
    # 192 rows sit just above a 7B's ridge on an H100 (~150: 7 ms of compute vs 5.6 ms of
    # weight reads): in the benchmark 256 gives text p99 2.2x unloaded, 192 1.9x, and 128 (below
    # the ridge) 1.55x but the burst's p99 TTFT grows from 20 s to 27 s.
    lump_prefill_tokens_per_step: int | None = 192
    # Lumpy only. A step that carries a quick request's first-token work gives lumps no
    # prefill rows, no tower work and no start (at most every other step; an aged lump
    # starts at most one step later). Without it the slowest text requests are those whose own step
    # also ran a 13-tile tower pass (~22 ms on an H100) and a lump chunk. In the
    # lumpy_admission benchmark it takes text p99 TTFT from 1.94x to 1.60x unloaded with
    # one burst and from 2.19x to 1.85x with one a minute, for +0.6-1.3% on the bursts'
    # p99 TTFT (lumps lose the steps that start a text request: ~10% at 10 req/s).
    lump_yields_to_quick: bool = True
    # Plan step i+1 while step i's forward runs on another thread (NanoFlow §4.2.1): the
    # planning and bookkeeping are hidden behind the forward, and a request that stops
    # (stop token or string) is noticed one step late, costing one extra token of compute
    # that is never emitted. Outputs are identical either way. A speculating engine runs
    # synchronously: its drafts need the previous step's tokens. Off by default: on a CPU
    # it hides most of the host's time from the forward, but the forward's own Python
    # shares the GIL with the engine thread's and slows by about as much, so the wall time
    # barely moves (benchmarks/engine/async_scheduling.py and its results file). Unmeasured on a
    # GPU, where it is meant to pay.
    async_scheduling: bool = False
    # Lumpy only. Latency targets: with a TTFT target the waiting requests are ordered by
    # slack against their class's target (least first, the aging bound kept); with a TPOT
    # target and a step-cost model (`Scheduler(step_cost=...)`) a step gives lumps only
    # the prefill rows and tiles that keep a step carrying decodes under it.
    slo: SloConfig = SloConfig()
    # Lumpy only, the adaptive lump budget (`scheduler.lump_budget`): the per-step caps
    # are lifted after this many steps without a quick request needing them, then the
    # lumps' share doubles each further quiet step up to the whole budget. A quick
    # request arriving brings the caps back in the same step. 2: a quick request every
    # other step keeps the caps on (no flapping).
    lump_release_steps: int = 2

    def __post_init__(self) -> None:
        if self.lump_release_steps < 0:
            raise ValueError(f"lump_release_steps={self.lump_release_steps} must be >= 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.admission not in ("fcfs", "lumpy"):
            raise ValueError(f"admission={self.admission!r} must be 'fcfs' or 'lumpy'")
        if self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps={self.max_wait_steps} must be >= 0")
        if self.encoder_tiles_per_step is not None and self.encoder_tiles_per_step < 1:
            raise ValueError(
                f"encoder_tiles_per_step={self.encoder_tiles_per_step} must be >= 1 (or None)"
            )
        if self.decode_reserve_tokens < 0:
            raise ValueError(f"decode_reserve_tokens={self.decode_reserve_tokens} must be >= 0")
        if not 0.0 <= self.lump_headroom < 1.0:
            raise ValueError(f"lump_headroom={self.lump_headroom} must be in [0, 1)")
        cap = self.lump_prefill_tokens_per_step
        if cap is not None and cap < 1:
            raise ValueError(f"lump_prefill_tokens_per_step={cap} must be >= 1 (or None)")


DEFAULT_DRAFTS = 4  # γ_max when num_speculative_tokens is left at None


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram speculative decoding (article §15): on by default, with adaptive γ."""

    # γ_max: drafts per sequence per step; 0 = off. None (the default): DEFAULT_DRAFTS, or off
    # where async scheduling was asked for (drafts need the step before's tokens); the
    # engine resolves it (vlmserve/sample/verify.py: resolve_speculation). On by default
    # because it is gated: adaptive γ drafts only below the ridge B* (calibrated for the CPU
    # in the engine's dtype) and for sequences whose drafts are accepted, so it drafts
    # nothing where it cannot pay; benchmarks/engine/spec_decode.py found it never slower
    # than off beyond noise at 1-64 requests (docs/engine.md, "Speculation").
    num_speculative_tokens: int | None = None
    # Suffix lengths the n-gram proposer tries, longest first.
    min_n: int = 2
    max_n: int = 4
    # Adaptive γ: per step from the ridge (B·(γ+1) ≤ B*), per sequence from its recent
    # acceptance rate. False: always propose γ_max (still capped by tokens left).
    adaptive: bool = True
    # B* (article §11) in query rows; None: the engine derives it for its device.
    ridge_batch: float | None = None
    # Cost of one extra verified row relative to a decode step, below the ridge (the
    # `c` of §15's speed-up E[tokens]/(1 + γ·c)); the per-sequence γ maximises that.
    row_cost: float = 0.1
    # The acceptance rate: prior (weighted as one trial) and how fast old evidence fades,
    # per verification. A sequence switched off retries one draft every probe_interval
    # decode steps, so a later copy-heavy stretch is noticed.
    prior_acceptance: float = 0.5
    acceptance_decay: float = 0.9
    probe_interval: int = 16

    def __post_init__(self) -> None:
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 0")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n={self.min_n} <= max_n={self.max_n}")
        if self.ridge_batch is not None and self.ridge_batch <= 0:
            raise ValueError(f"ridge_batch={self.ridge_batch} must be > 0")
        if self.row_cost < 0:
            raise ValueError(f"row_cost={self.row_cost} must be >= 0")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance={self.prior_acceptance} must be in [0, 1]")
        if not 0.0 <= self.acceptance_decay < 1.0:
            raise ValueError(f"acceptance_decay={self.acceptance_decay} must be in [0, 1)")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval={self.probe_interval} must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens != 0  # None: on unless async scheduling

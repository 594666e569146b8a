"""What one engine step costs on a preset accelerator: a roofline over the step's work.

A step encodes some tiles (the ViT, compute-bound, before the LLM runs), then one LLM
forward over its query rows: prefill chunk tokens plus decode rows. That forward reads
the weights once and the KV of every scheduled sequence, and does 2·P FLOPs per dense
row plus 4·L·d per (query row, key) pair (§3: the ``4·L·N·d`` of a decode step; for a
whole prompt the "full" variant that reproduces §17's 36.6 TFLOP). Its time is the
larger of the compute time and the memory time (§10, §11); the ViT adds on top. A
sliding-window model's (Gemma 3) sliding layers read, and attend over, only their window
(what the engine's hybrid KV manager keeps: scheduler/kv_blocks.py), its global ones the
whole context: `StepWork` counts both.

Where the roofline does not describe the machine (a model of a few million parameters on
a CPU: the host's per-step and per-sequence work, which no FLOP or byte count sees,
dominates), `MeasuredStepCost` replaces it: a linear model fitted (`fit_step_cost`) to
steps of the real engine timed on that machine.

Pure functions: the trace simulator (search/sim/trace_sim.py) prices every step with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from scheduler.config import kv_cache_groups
from scheduler.lump_budget import StepShape, add_shapes, chunk_shape
from search.costmodel import cost_model as cm
from search.costmodel.presets import Accelerator, ModelShape, VisionEncoder
from search.image_budget import ImageAssumptions, vit_flops


@dataclass(frozen=True)
class StepWork:
    """The shape of one step, counted from its plan."""

    num_prefill_tokens: int = 0  # query rows of prefill chunks (recomputation included)
    num_decode_rows: int = 0  # one row per decoding sequence
    # Σ over query rows of the keys each attends (a row at position p sees p + 1 keys;
    # a chunk is priced as if every row saw the whole chunk: the article's full variant).
    num_attention_pairs: int = 0
    num_kv_tokens_read: int = 0  # Σ over scheduled sequences of their context after the step
    num_tiles_encoded: int = 0  # ViT tiles run this step (encoder-cache misses only)
    num_seqs: int = 0  # sequences scheduled (host work per sequence: tables, sampling)
    # The same two counts for the model's sliding-window layers (Gemma 3), clipped to its
    # window (a row's pairs and a sequence's context each at most the window),
    # as `count_work` makes them. None: not counted (a caller that does not know the
    # window); those layers are then priced as global ones, an upper bound.
    num_kv_tokens_read_in_window: int | None = None
    num_attention_pairs_in_window: int | None = None

    @property
    def num_dense_rows(self) -> int:
        return self.num_prefill_tokens + self.num_decode_rows


@dataclass(frozen=True)
class MeasuredStepCost:
    """Seconds of one step as fitted to an engine timed on one machine: a fixed part, and
    parts per scheduled sequence, dense row, (query row, key) pair and tower tile."""

    per_step_s: float
    per_seq_s: float
    per_row_s: float
    per_pair_s: float
    per_tile_s: float

    def __post_init__(self) -> None:
        if min(dataclasses.astuple(self)) < 0:
            raise ValueError(f"step cost coefficients must be >= 0: {self}")

    def split(self, work: StepWork) -> tuple[float, float]:
        """(tower seconds, the rest) of `work`; an empty step costs nothing."""
        vit_s = self.per_tile_s * work.num_tiles_encoded
        if work.num_dense_rows == 0 and work.num_tiles_encoded == 0:
            return 0.0, 0.0
        rest = (
            self.per_step_s
            + self.per_seq_s * work.num_seqs
            + self.per_row_s * work.num_dense_rows
            + self.per_pair_s * work.num_attention_pairs
        )
        return vit_s, rest


def _features(work: StepWork) -> list[float]:
    return [
        1.0,
        float(work.num_seqs),
        float(work.num_dense_rows),
        float(work.num_attention_pairs),
        float(work.num_tiles_encoded),
    ]


def _nnls(x, y):
    """Least squares with every coefficient >= 0: a term that would fit below zero is
    dropped and the rest refitted (the active-set method)."""
    import numpy as np

    # Scale the columns so the solve is well conditioned (pairs run to 1e5, the step to 1).
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    active = [j for j in range(x.shape[1]) if x[:, j].any()]
    coef = np.zeros(0)
    while active:
        coef, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        if coef.min() >= 0:
            break
        del active[int(coef.argmin())]
    full = np.zeros(x.shape[1])
    full[active] = coef / scale[active]
    return full


def fit_step_cost(
    samples: list[tuple[StepWork, float]], outlier_factor: float = 5.0,
    tower_s: list[float] | None = None,
) -> MeasuredStepCost:  # fmt: skip
    """Non-negative least squares of step seconds on the `MeasuredStepCost` terms, in
    relative error (a 2 ms step counts as much as a 30 ms one, and a stall can be off by
    at most 100%). Steps that took longer than the fit by more than `outlier_factor` times
    the median relative error (on a shared machine: a step stalled by other work) are then
    left out and the rest refitted, twice: a 30 ms step slowed by a third is kept, a 2 ms
    step that took 200 ms is not.

    `tower_s` (per sample, the vision tower's own seconds within the step, timed around
    its call): the tile term is then that time per tile (the median over the steps that
    encode, so a stalled one does not set it), and the other terms are fitted to the rest
    of each step. A few dozen tower steps among thousands of decodes otherwise leave the
    tile term to the least squares' trade-offs between terms (fits 2x apart were seen on
    one machine, and an image's TTFT follows the tile term)."""
    import numpy as np

    if len(samples) < 5:
        raise ValueError(f"need at least 5 timed steps to fit 5 terms, got {len(samples)}")
    x = np.array([_features(work) for work, _ in samples])
    y = np.array([seconds for _, seconds in samples])
    if y.min() <= 0:
        raise ValueError("step times must be > 0")
    if tower_s is None:
        return MeasuredStepCost(*(float(c) for c in _fit_relative(x, y, outlier_factor)))
    tower = np.array(tower_s)
    if tower.shape != y.shape or tower.min() < 0 or (tower >= y).any():
        raise ValueError("tower seconds: one per sample, >= 0 and less than its step's")
    tiles = x[:, 4]
    encoding = tiles > 0
    per_tile = float(np.median(tower[encoding] / tiles[encoding])) if encoding.any() else 0.0
    x[:, 4] = 0.0  # an all-zero column: the fit leaves its term at 0
    coef = _fit_relative(x, y - tower, outlier_factor)
    coef[4] = per_tile
    return MeasuredStepCost(*(float(c) for c in coef))


def _fit_relative(x, y, outlier_factor: float):
    import numpy as np

    xr = x / y[:, None]  # rows scaled by 1/t: least squares of the relative error
    ones = np.ones(len(y))
    keep = ones.astype(bool)
    coef = _nnls(xr, ones)
    for _ in range(2):
        relative = (y - x @ coef) / y
        limit = outlier_factor * np.median(np.abs(relative[keep]))
        keep = relative <= max(limit, 1e-9)
        coef = _nnls(xr[keep], ones[keep])
    return coef


@dataclass(frozen=True)
class StepHardware:
    """What the step runs on: backbone, tower, device, and the §17 efficiency constants."""

    model: ModelShape
    encoder: VisionEncoder
    accel: Accelerator
    assumptions: ImageAssumptions = ImageAssumptions()
    cache_bytes: float = 2.0
    # Fixed per-step cost (launches, scheduling, sampling); 0 keeps the pure roofline.
    step_overhead_s: float = 0.0
    # Set: step times come from this fit of the real engine instead of the roofline.
    measured: MeasuredStepCost | None = None


class StepTime(NamedTuple):
    vit_s: float
    compute_s: float
    memory_s: float
    total_s: float


def chunk_attention_pairs(num_computed: int, num_new: int) -> int:
    """(query row, key) pairs of a chunk of `num_new` rows after `num_computed` cached
    tokens, every row priced at the full context: n·(c + n). For a whole prompt that is
    n², the "full" term of §17's prefill; for a decode (n = 1) it is the context N."""
    return num_new * (num_computed + num_new)


def sliding_window_of(model: ModelShape) -> int | None:
    """The window of `model`'s sliding layers; None when it has none."""
    return model.sliding_window if model.num_sliding_layers else None


def count_work(
    chunks: Iterable[tuple[int, int, bool]], num_tiles: int = 0, window: int | None = None
) -> StepWork:
    """A step's work from (tokens computed before, new tokens, is a decode) per scheduled
    sequence: how the simulator and the engine's calibration count a plan, by the
    scheduler's own count (`scheduler.lump_budget.chunk_shape`: a chunk's pairs priced at
    its whole context, a sliding layer's at most `window` keys a row). `window`: the
    model's sliding window (`sliding_window_of`), which adds the windowed counts."""
    shape = StepShape()
    for start, n, is_decode in chunks:
        shape = add_shapes(shape, chunk_shape(start, n, 0, is_decode, window))
    return StepWork(*shape._replace(num_tiles_encoded=num_tiles))


def _sliding_layers(work: StepWork, model: ModelShape) -> int:
    """Layers priced at the windowed counts: the sliding ones, once `work` counted them."""
    if work.num_kv_tokens_read_in_window is None or work.num_attention_pairs_in_window is None:
        return 0
    return model.num_sliding_layers if model.sliding_window is not None else 0


def step_time(work: StepWork, hw: StepHardware) -> StepTime:
    """t = t_vit + max(t_compute, t_memory) + overhead, in seconds (with a measured cost:
    its fit, the non-tower part reported as compute)."""
    if hw.measured is not None:
        vit_s, rest = hw.measured.split(work)
        return StepTime(vit_s, rest, 0.0, vit_s + rest)
    model, a = hw.model, hw.assumptions
    peak = hw.accel.peak_flops("bf16")
    vit_s = 0.0
    if work.num_tiles_encoded:
        vit_s = cm.compute_time(
            vit_flops(hw.encoder, work.num_tiles_encoded), peak, a.vit_efficiency
        )
    if work.num_dense_rows == 0:
        return StepTime(vit_s, 0.0, 0.0, vit_s + (hw.step_overhead_s if vit_s else 0.0))
    flops = 2 * model.num_params * work.num_dense_rows
    num_sliding = _sliding_layers(work, model)
    if num_sliding:  # global layers over every key, sliding ones over their window's
        num_global = model.num_layers - num_sliding
        pairs = num_global * float(work.num_attention_pairs)
        pairs += num_sliding * float(work.num_attention_pairs_in_window)
        flops += 4 * model.hidden_size * pairs
        kv_bytes = cm.kv_bytes_hybrid(
            model, work.num_kv_tokens_read, work.num_kv_tokens_read_in_window, hw.cache_bytes
        )
    else:
        flops += 4 * model.num_layers * model.hidden_size * float(work.num_attention_pairs)
        kv_bytes = cm.kv_bytes_all_global(model, work.num_kv_tokens_read, hw.cache_bytes)
    compute_s = cm.compute_time(flops, peak, a.prefill_efficiency)
    memory_s = (cm.weight_bytes_total(model, a.weight_bytes) + kv_bytes) / hw.accel.mem_bandwidth
    total = vit_s + max(compute_s, memory_s) + hw.step_overhead_s
    return StepTime(vit_s, compute_s, memory_s, total)


def kv_windows(model: ModelShape) -> tuple[int | None, ...]:
    """The sliding window of each KV cache group the engine's hybrid KV manager makes of
    `model`'s layers (scheduler/kv_blocks.py; one group without sliding layers)."""
    num_global = model.num_layers - model.num_sliding_layers
    layers = [model.sliding_window] * model.num_sliding_layers + [None] * num_global
    return tuple(g.sliding_window for g in kv_cache_groups(layers))


def kv_layers_per_block(model: ModelShape) -> int:
    """Layers whose KV one pool block holds: every layer, or a hybrid group's share."""
    num_global = model.num_layers - model.num_sliding_layers
    layers = [model.sliding_window] * model.num_sliding_layers + [None] * num_global
    return max(len(g.layers) for g in kv_cache_groups(layers))


def kv_pool_blocks(hw: StepHardware, block_size: int) -> int:
    """KV blocks that fit beside the backbone, the tower and the workspace (§17's ledger).
    A hybrid model's block holds one KV cache group's layers (`kv_layers_per_block`)."""
    a = hw.assumptions
    resident = (hw.model.num_params + hw.encoder.num_params) * a.weight_bytes + a.workspace_bytes
    share = kv_layers_per_block(hw.model) / hw.model.num_layers
    per_block = cm.kv_bytes_per_token(hw.model, hw.cache_bytes) * block_size * share
    num_blocks = int((hw.accel.memory_bytes - resident) // per_block)
    if num_blocks < 1:
        raise ValueError(
            f"{hw.model.name} and {hw.encoder.name} leave no KV cache on {hw.accel.name} "
            f"({hw.accel.memory_bytes / 1e9:.3g} GB)"
        )
    return num_blocks

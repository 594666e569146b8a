"""Verifying n-gram drafts losslessly (article §15).

A speculating sequence's γ drafts come back with γ+1 rows of logits: row i is the
target's distribution for the token after draft i-1 (row 0: after the last real token).
- greedy: accept the longest prefix where draft == argmax, then emit the argmax at the
  first mismatch, or the bonus argmax of row γ when every draft held. The output is
  exactly that of plain greedy decoding.
- sampling: the draft is deterministic (q = a point mass on d), so the rejection rule
  accept-with-min(1, p/q) becomes: accept d with probability p(d); on rejection sample
  from max(0, p - q) normalised, which is p with d removed and renormalised. Each token
  is then distributed exactly as plain sampling from p (Leviathan et al., Chen et al.).
p is the request's filtered distribution (temperature, top-k, top-p). Every row of the
step is drawn at once (`batch_sampler`): each row gets its accept test and its draw from p
without its draft, the uniforms come from the request's own seeded generator, and the host
keeps the drafts up to the first rejection. A request's tokens do not depend on the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import statistics
from typing import TYPE_CHECKING

import torch

from kernels import calibration
from kernels.packed_linear import dtype_name, plain_gemm
from scheduler.config import DEFAULT_DRAFTS, SpeculativeConfig
from scheduler.step_plan import ScheduledSeq
from search.costmodel.cost_model import b_star
from search.costmodel.presets import (
    Precision,
    copy_bandwidth,
    cpu_accelerator,
    get_accelerator,
    gpu_preset,
)
from vlmserve.sample.logprobs import book_emitted
from vlmserve.sample.params import SamplerState
from vlmserve.sample.sampler import GroupResult, RowGroup, sample_rows

if TYPE_CHECKING:  # imports xgrammar: only once a constrained request arrives
    from vlmserve.config import EngineConfig
    from vlmserve.sample.masks import FillJob

log = logging.getLogger(__name__)


def verify_greedy(targets: list[int], drafts: tuple[int, ...]) -> list[int]:
    """The longest prefix of `drafts` that matches the argmaxes `targets` (one per row,
    len(drafts) + 1), then the argmax at the first mismatch (or the bonus one)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return [*drafts[:accepted], targets[accepted]]


def accept_drafts(drafts: tuple[int, ...], result: GroupResult) -> list[int]:
    """Rejection sampling from per-row draws: the drafts up to the first rejected one, then
    that row's token (drawn from p without the draft), or every draft and the bonus token."""
    for i, accepted in enumerate(result.accepted):  # one flag per draft
        if not accepted:
            return [*drafts[:i], result.token_ids[i]]
    return [*drafts, result.token_ids[len(drafts)]]


def _emitted(group: RowGroup, result: GroupResult) -> list[int] | Exception:
    if result.error is not None:
        return ValueError(result.error)
    if group.state.params.greedy:
        return verify_greedy(result.token_ids, group.draft_token_ids)
    return accept_drafts(group.draft_token_ids, result)


def verify(logits: torch.Tensor, drafts: tuple[int, ...], state: SamplerState) -> list[int]:
    """The accepted drafts and one more token, for one request alone (`sample_plan` does
    every request of a step at once). logits: [len(drafts) + 1, vocab]."""
    group = RowGroup(state, 0, drafts)
    out = _emitted(group, sample_rows(logits, [group])[0])
    if isinstance(out, Exception):
        raise out
    return out


def plan_groups(scheduled: list[ScheduledSeq], samplers: list[SamplerState]) -> list[RowGroup]:
    """One RowGroup per sampling item of a step, in plan order: its sampler and its rows
    of the logits (one per draft, then the bonus row)."""
    groups: list[RowGroup] = []
    row, states = 0, iter(samplers)
    for item in scheduled:
        if item.sample:
            groups.append(RowGroup(next(states), row, item.draft_token_ids))
            row += 1 + len(item.draft_token_ids)
    return groups


def start_masks(
    scheduled: list[ScheduledSeq], samplers: list[SamplerState], vocab: int
) -> FillJob | None:
    """Start filling the step's grammar masks beside its forward pass (None when no row is
    constrained); `sample_plan` applies them. xgrammar is imported only once a
    constrained request arrives."""
    if all(state.grammar is None for state in samplers):
        return None
    from vlmserve.sample.masks import start_fill

    groups = plan_groups(scheduled, samplers)
    return start_fill(groups, sum(1 + len(g.draft_token_ids) for g in groups), vocab)


def sample_plan(
    scheduled: list[ScheduledSeq],
    logits: torch.Tensor,
    samplers: list[SamplerState],
    masks: FillJob | None = None,
) -> list[list[int] | Exception]:
    """The tokens each scheduled item emits ([] for a prefill chunk that does not sample),
    or the exception its sampling raised: that fails the request alone, and the others
    keep the tokens (and generator states) they would have had anyway.
    logits: [num_sampling_rows, vocab] as the runner returns them; `samplers` has one
    state per sampling item, in plan order; `masks`: the grammar masks `start_masks`
    began filling (filled here when a row is constrained and none were started)."""
    groups = plan_groups(scheduled, samplers)
    constrained = any(group.state.grammar is not None for group in groups)
    try:
        if constrained:
            from vlmserve.sample.masks import apply_masks, fill_masks

            filled = masks.result() if masks is not None else fill_masks(groups, *logits.shape)
            dead = apply_masks(logits, filled)  # refused tokens -> -inf, in place
        # All rows where the logits are; only token ids and flags come back.
        results = sample_rows(logits, groups)
    except Exception as e:  # noqa: BLE001 - belongs to no one request: fails the samplers
        return [e if item.sample else [] for item in scheduled]
    emitted = [_emitted(group, result) for group, result in zip(groups, results, strict=True)]
    if constrained:
        from vlmserve.sample.masks import advance_grammars

        emitted = advance_grammars(groups, emitted, dead)
    book_emitted(logits, groups, emitted)  # histories for the controls, logprobs
    taken = iter(emitted)
    return [next(taken) if item.sample else [] for item in scheduled]


def takes_argmax(samplers: list[SamplerState]) -> bool:
    """Whether a step's tokens need no more than each row's argmax (`greedy_plan`): some
    request samples, and every one is greedy without logit controls, constraint or
    logprobs."""
    return bool(samplers) and all(
        s.params.greedy and not s.params.has_logit_controls and s.params.logprobs is None
        and s.grammar is None for s in samplers
    )  # fmt: skip


def greedy_plan(
    scheduled: list[ScheduledSeq], argmaxes: torch.Tensor, samplers: list[SamplerState]
) -> list[list[int] | Exception]:
    """`sample_plan`'s result for a step that `takes_argmax`, from its rows' argmaxes
    ([num_sampling_rows] long, plan order) instead of their logits: the same tokens."""
    targets = argmaxes.tolist()
    emitted = []
    for group in plan_groups(scheduled, samplers):
        rows = targets[group.first_row : group.first_row + 1 + len(group.draft_token_ids)]
        emitted.append(verify_greedy(rows, group.draft_token_ids))
        group.state.output_token_ids.extend(emitted[-1])  # as `book_emitted` does
    taken = iter(emitted)
    return [next(taken) if item.sample else [] for item in scheduled]


# The square GEMM whose rate stands for a CPU's π: big enough to keep every thread's
# tiles busy (at 1024² two AMX cores reach 60% of it).
RIDGE_GEMM = 2048


def resolve_speculation(
    engine: EngineConfig, device: torch.device, dtype: torch.dtype,
    decoder: torch.nn.Module | None = None,
) -> SpeculativeConfig:  # fmt: skip
    """The engine's speculation as it runs: γ_max settled (the default's is DEFAULT_DRAFTS,
    or off under async scheduling) and B* filled in for adaptive γ (`ridge_batch_for`, and
    on a CPU the `decoder`'s quantized linears' own, `quantized_ridge`, where lower), or
    off on a GPU no accelerator preset matches (no B*: a warning names the fixed-γ way)."""
    config = engine.speculative
    if config.num_speculative_tokens is None:
        gamma = 0 if engine.scheduler.async_scheduling else DEFAULT_DRAFTS
        config = dataclasses.replace(config, num_speculative_tokens=gamma)
    if not (config.enabled and config.adaptive and config.ridge_batch is None):
        return config
    try:
        ridge = ridge_batch_for(device, dtype)
    except ValueError as e:
        log.warning("speculation off: %s", e)
        return dataclasses.replace(config, num_speculative_tokens=0)
    if decoder is not None and device.type == "cpu":
        ridge = min(ridge, quantized_ridge(decoder, dtype))
    return dataclasses.replace(config, ridge_batch=ridge)


def ridge_batch_for(device: torch.device, dtype: torch.dtype) -> float:
    """B* = s_w·π/(2β) (article §11) for the engine's device and weight dtype: a datasheet
    preset for a GPU (one no preset matches is refused), this CPU calibrated in `dtype`
    (`measure_cpu_ridge`, cached with the kernel choices)."""
    weight = Precision(str(dtype), torch.finfo(dtype).bits / 8, "bf16")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        preset = gpu_preset(name, "--no-adaptive-speculation drafts a fixed γ without it")
        return b_star(get_accelerator(preset), weight)
    return calibration.calibrated(
        f"ridge/{dtype_name(dtype)}", functools.partial(measure_cpu_ridge, dtype),
        functools.partial(decide_ridge, weight),
    )  # fmt: skip


def measure_cpu_ridge(dtype: torch.dtype) -> calibration.Measured:
    """π as torch's GEMM reaches it in `dtype` (the library and format the step's GEMMs run
    in: bfloat16 on AMX tiles through oneDNN where the CPU has them, 6x its float32 on
    the AMX Xeon), β a copy's: a float32 peak would put bfloat16's B* at a sixth of it."""
    n = RIDGE_GEMM
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    # plain_gemm: where oneDNN takes no bfloat16 the layers multiply it widened to float32
    seconds = calibration.time_paths({"gemm": lambda: plain_gemm(a, b)})["gemm"]
    return [{"gemm_flops": 2 * n**3 / seconds, "copy_bytes_per_s": copy_bandwidth()}]


def decide_ridge(weight: Precision, measured: calibration.Measured) -> float:
    """B* of a CPU with the measured GEMM rate and copy bandwidth."""
    (m,) = measured
    return b_star(cpu_accelerator(m["gemm_flops"], m["copy_bytes_per_s"]), weight)


# Rows of x the quantized linears are timed at for their B*: past 8, where a packed Q8_0 /
# Q5_0 weight's kernel starts a second pass over its tile (flat to 8 rows, its slope over
# 5-8 rows put B* at 12-29 rows, noise, on a Zen 4).
QUANT_RIDGE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)


def quantized_ridge(decoder: torch.nn.Module, dtype: torch.dtype) -> float:
    """B* of a decoder whose linears run from quantized blocks (inf: none do), measured as
    the article defines it (§11: the rows whose arithmetic takes what one row's weight read
    does): its quantized linears, run one after another as a decode step runs them, at one
    row, over what each row adds once they are bound by their instructions (the slope over
    the last rows timed). From the weights' bytes alone B* would be the bfloat16 one, yet
    the blocks' integer kernels do per-row work from a few rows on (the Zen 4: a decode
    step's 1, 3, 5 and 8 rows in 8.4, 10.7, 18.1 and 25.4 ms: B* 3.5 rows)."""
    from kernels.quant_linear import QuantLinear

    layers = [m for m in decoder.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return math.inf
    shapes = sorted({(p.qtype, p.in_features, p.out_features) for m in layers for p in m.parts})
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]

    def measure() -> calibration.Measured:
        steps = {}
        for rows in QUANT_RIDGE_ROWS:
            xs = [torch.randn(rows, m.in_features).to(dtype) for m in layers]

            def step(xs: list[torch.Tensor] = xs) -> None:
                for layer, x in zip(layers, xs, strict=True):
                    layer(x)

            step()  # every size once first: the weights paged in, each layer's path chosen
            steps[rows] = step
        return [{"rows": r, **calibration.time_paths({"step": f})} for r, f in steps.items()]

    name = f"ridge_quantized/{dtype_name(dtype)}/{digest}"
    return calibration.calibrated(name, measure, decide_quantized_ridge)


def decide_quantized_ridge(measured: calibration.Measured) -> float:
    """One row's time over the least-squares slope of the last four sizes (at least 1)."""
    one = next(m["step"] for m in measured if m["rows"] == 1)
    tail = sorted(measured, key=lambda m: m["rows"])[-4:]
    slope, _ = statistics.linear_regression([m["rows"] for m in tail], [m["step"] for m in tail])
    return max(1.0, one / slope) if slope > 0 else math.inf

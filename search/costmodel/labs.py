"""The article's Labs 1–3 as pure functions returning small records.

Lab 1 is capacity accounting (§5, §8), Lab 2 the serving planner (§8, §10, §13, §16),
Lab 3 the batching limits (§11). All times are roofline floors; real engines land above.
"""

from __future__ import annotations

from dataclasses import dataclass

from search.costmodel import cost_model as cm
from search.costmodel.presets import Accelerator, ModelShape, Precision

PREFILL_EFFICIENCY = 0.45  # §3 / Lab 2: prefill runs at ~45% of dense peak


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_parallel(model: ModelShape, tp: int) -> None:
    _require(tp >= 1, f"tensor parallel degree must be >= 1, got {tp}")
    _require(
        model.num_heads % tp == 0,
        f"tensor parallel degree {tp} does not divide the {model.num_heads} attention heads",
    )


@dataclass(frozen=True)
class KvReport:
    """Lab 1: what a batch of sequences at one context length does to a device."""

    kv_bytes_per_token: float
    kv_bytes_per_sequence: float
    kv_bytes_total: float
    weight_bytes: float
    device_bytes_used: float
    device_fraction_used: float
    max_concurrency: int
    kv_bytes_read_per_step: float
    # Tensor parallelism (§16): what one device holds. The cache splits min(n, n_kv) ways;
    # past n_kv every KV head is on n/n_kv devices.
    tp: int = 1
    kv_bytes_per_token_per_device: float = 0.0
    kv_replicas: int = 1


def kv_report(
    model: ModelShape,
    accel: Accelerator,
    context_len: int,
    batch: int,
    weight: Precision,
    cache: Precision,
    workspace_bytes: float = 0.0,
    tp: int = 1,
) -> KvReport:
    """Lab 1: capacity only; no allocator overhead, so max concurrency is a ceiling. With
    `tp` > 1 the device figures (used, fraction, concurrency, per-device KV per token)
    are one device's: weights / n, cache / min(n, n_kv) (§16)."""
    _require(context_len >= 1, f"context length must be >= 1, got {context_len}")
    _require(batch >= 1, f"concurrent sequences must be >= 1, got {batch}")
    _check_parallel(model, tp)
    s_w, s_c = weight.bytes_per_element, cache.bytes_per_element
    weights = cm.weight_bytes_total(model, s_w)
    total = cm.kv_cache_bytes(model, context_len, batch, s_c)
    shards = cm.cache_shards(model, tp)
    used = weights / tp + total / shards + workspace_bytes
    return KvReport(
        kv_bytes_per_token=cm.kv_bytes_per_token(model, s_c),
        kv_bytes_per_sequence=cm.kv_bytes_per_sequence(model, context_len, s_c),
        kv_bytes_total=total,
        weight_bytes=weights,
        device_bytes_used=used,
        device_fraction_used=used / accel.memory_bytes,
        max_concurrency=cm.b_max(model, accel, context_len, s_w, s_c, workspace_bytes, tp),
        # Every resident cache is read in full on each decode step (§10).
        kv_bytes_read_per_step=total,
        tp=tp,
        kv_bytes_per_token_per_device=cm.kv_bytes_per_token(model, s_c) / shards,
        kv_replicas=tp // shards,
    )


@dataclass(frozen=True)
class ServingPlan:
    """Lab 2: does it fit, and the three latencies a deployment is judged on."""

    fits: bool
    device_bytes_used: float
    ttft_s: float
    tpot_s: float
    e2e_s: float
    tokens_per_s_per_user: float
    tokens_per_s_total: float
    kv_share_of_step_bytes: float
    decode_intensity: float
    cache_replicated: bool


def serving_plan(
    model: ModelShape,
    accel: Accelerator,
    prompt_tokens: int,
    output_tokens: int,
    batch: int,
    weight: Precision,
    cache: Precision,
    tp: int = 1,
    workspace_bytes: float = 2e9,
) -> ServingPlan:
    """Lab 2 on one device of an n-way tensor-parallel group.

    TTFT is one prompt's prefill at 45% of peak (light load, no queueing). TPOT is the
    decode wall at the mean context N_p + N_o/2; the step time is linear in N, so
    N_o × mean TPOT is exactly the decode time of the whole generation.
    """
    _require(prompt_tokens >= 1, f"prompt tokens must be >= 1, got {prompt_tokens}")
    _require(output_tokens >= 1, f"output tokens must be >= 1, got {output_tokens}")
    _require(batch >= 1, f"batch must be >= 1, got {batch}")
    _check_parallel(model, tp)
    s_w, s_c = weight.bytes_per_element, cache.bytes_per_element
    final_ctx = prompt_tokens + output_tokens
    mean_ctx = prompt_tokens + output_tokens // 2
    used = (
        cm.weight_bytes_total(model, s_w) / tp
        + cm.kv_cache_bytes(model, final_ctx, batch, s_c) / cm.cache_shards(model, tp)
        + workspace_bytes
    )
    peak = tp * accel.peak_flops(weight.compute_dtype)
    ttft = cm.compute_time(cm.prefill_flops(model, prompt_tokens), peak, PREFILL_EFFICIENCY)
    tpot = cm.decode_step_time(model, accel, mean_ctx, batch, s_w, s_c, tp)
    step_bytes = cm.decode_step_bytes(model, mean_ctx, batch, s_w, s_c)
    return ServingPlan(
        fits=used <= accel.memory_bytes,
        device_bytes_used=used,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=cm.e2e_latency(ttft, tpot, output_tokens),
        tokens_per_s_per_user=1 / tpot,
        tokens_per_s_total=batch / tpot,
        kv_share_of_step_bytes=(step_bytes - s_w * model.num_params) / step_bytes,
        decode_intensity=cm.decode_intensity(model, mean_ctx, batch, s_w, s_c),
        cache_replicated=tp > cm.cache_shards(model, tp),
    )


@dataclass(frozen=True)
class BatchingLimits:
    """Lab 3: the three batch limits and what intensity and throughput they allow."""

    b_star: float
    b_cross: float
    b_max: int
    intensity_at_b_max: float | None
    intensity_ceiling: float
    ceiling_fraction_of_peak: float
    throughput_ceiling: float
    optimal_throughput: float
    nanoflow_tr_at_b_max: float | None


def batching_limits(
    model: ModelShape,
    accel: Accelerator,
    context_len: int,
    weight: Precision,
    cache: Precision,
    tp: int = 1,
    workspace_bytes: float = 2e9,
) -> BatchingLimits:
    """Lab 3 (per device), plus NanoFlow's compute-only optimum for the same device.

    ``intensity_at_b_max`` and the TR are None when not even one sequence fits.
    """
    _require(context_len >= 1, f"context length must be >= 1, got {context_len}")
    _check_parallel(model, tp)
    s_w, s_c = weight.bytes_per_element, cache.bytes_per_element
    limit = cm.b_max(model, accel, context_len, s_w, s_c, workspace_bytes, tp)
    ceiling = cm.intensity_ceiling(model, context_len, s_c)
    peak = accel.peak_flops(weight.compute_dtype)
    # NanoFlow Eq. 5 counts every GEMM FLOP of the whole model against one device's share.
    optimum = cm.optimal_throughput(tp * peak, model.num_params)
    tr = None
    if limit:
        tr = cm.nanoflow_tr(
            accel.memory_bytes, accel.mem_bandwidth, limit, model.num_params / tp, peak
        )
    return BatchingLimits(
        b_star=cm.b_star(accel, weight),
        b_cross=cm.b_cross(model, context_len, s_w, s_c, tp),
        b_max=limit,
        intensity_at_b_max=cm.decode_intensity(model, context_len, limit, s_w, s_c)
        if limit
        else None,
        intensity_ceiling=ceiling,
        ceiling_fraction_of_peak=ceiling / accel.ridge(weight.compute_dtype),
        throughput_ceiling=cm.throughput_ceiling(model, accel, context_len, s_c, tp),
        optimal_throughput=optimum,
        nanoflow_tr_at_b_max=tr,
    )

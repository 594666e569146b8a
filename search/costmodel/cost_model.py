"""Roofline cost model: pure functions over shapes, no device, no state.

Formulas from the reference article (§3–§16; section numbers in each docstring) and the
NanoFlow analysis (§3.2). Every function returns SI units: FLOP, bytes, seconds.
Byte widths (``weight_bytes``, ``cache_bytes``) are bytes per element: 2 for bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from search.costmodel.presets import Accelerator, ModelShape, Precision

AttentionMask = Literal["causal", "full"]

# --- §3 prefill and decode ------------------------------------------------------------


def prefill_flops(model: ModelShape, num_tokens: int, attention: AttentionMask = "causal") -> float:
    """W_prefill ≈ 2·P·N_p + c·L·N_p²·d (§3).

    c = 2 is the article's §3 variant (N² halved by causality: its 149 TFLOP at 8k).
    c = 4 ("full") is the variant behind §17's "LLM prefill over 2,400 tokens ≈ 36.6 TFLOP",
    which only reproduces without the causal halving; the image budget uses it.
    """
    c = 2 if attention == "causal" else 4
    n, d = float(num_tokens), model.hidden_size
    return 2 * model.num_params * n + c * model.num_layers * n * n * d


def decode_flops(model: ModelShape, context_len: int) -> float:
    """W_decode step ≈ 2·P + 4·L·N·d for one sequence against N cached positions (§3)."""
    return 2 * model.num_params + 4 * model.num_layers * float(context_len) * model.hidden_size


def decode_step_bytes(
    model: ModelShape,
    context_len: int,
    batch: int = 1,
    weight_bytes: float = 2.0,
    cache_bytes: float = 2.0,
) -> float:
    """Q = s_w·P + B·M_KV/seq: weights read once, every cache read in full (§3, §10)."""
    kv_seq = kv_bytes_per_sequence(model, context_len, cache_bytes)
    return weight_bytes * model.num_params + batch * kv_seq


def gemm_intensity(m: int, k: int, n: int, elem_bytes: float = 2.0) -> float:
    """I = 2mkn / [s(mk + kn + mn)]: compulsory HBM traffic of an (m×k)(k×n) GEMM (§3)."""
    return 2.0 * m * k * n / (elem_bytes * (m * k + k * n + m * n))


def compute_time(flops: float, peak_flops: float, efficiency: float = 1.0) -> float:
    """Seconds to run ``flops`` at ``efficiency`` of a dense peak (§3: prefill at 45%)."""
    assert 0 < efficiency <= 1, f"efficiency must be in (0, 1], got {efficiency}"
    return flops / (peak_flops * efficiency)


def generation_flops(
    model: ModelShape, prompt_tokens: int, output_tokens: int, use_cache: bool = True
) -> float:
    """Linear-layer FLOPs of a whole generation, with or without a KV cache (§4).

    No cache: Σ_t 2P(N_p + t) = 2P(N_o·N_p + N_o²/2); with cache: 2P(N_p + N_o).
    """
    p, n_p, n_o = model.num_params, float(prompt_tokens), float(output_tokens)
    if use_cache:
        return 2 * p * (n_p + n_o)
    return 2 * p * (n_o * n_p + n_o * n_o / 2)


# --- §5–§7 the KV cache --------------------------------------------------------------


def kv_bytes_per_token(model: ModelShape, cache_bytes: float = 2.0) -> float:
    """2·L·n_kv·d_head·s for MHA/GQA/MQA; L·(d_c + d_h^R)·s for MLA (§5, §6)."""
    if model.kv_lora_rank is not None:
        rope = model.qk_rope_head_dim or 0
        return model.num_layers * (model.kv_lora_rank + rope) * cache_bytes
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * cache_bytes


def kv_bytes_per_sequence(model: ModelShape, context_len: int, cache_bytes: float = 2.0) -> float:
    """M_KV/seq = N · bytes per token (§5); with sliding-window layers (a hybrid KV
    manager, vLLM's model) those hold min(N, window) tokens: the global layers' N tokens
    plus the sliding layers' window."""
    if not model.num_sliding_layers or model.sliding_window is None:
        return context_len * kv_bytes_per_token(model, cache_bytes)
    per_layer_token = kv_bytes_per_token(model, cache_bytes) / model.num_layers
    num_global = model.num_layers - model.num_sliding_layers
    held = num_global * context_len + model.num_sliding_layers * min(
        context_len, model.sliding_window
    )
    return held * per_layer_token


def kv_bytes_all_global(model: ModelShape, context_len: int, cache_bytes: float = 2.0) -> float:
    """The same sequence's KV were every layer global (the hybrid manager's saving's base)."""
    return context_len * kv_bytes_per_token(model, cache_bytes)


def kv_bytes_hybrid(
    model: ModelShape, num_tokens: int, num_tokens_in_window: int, cache_bytes: float = 2.0
) -> float:
    """KV bytes of `num_tokens` in the global layers and `num_tokens_in_window` (each
    sequence's min(N, window), summed) in the sliding ones: a batch's read under a hybrid
    KV manager, where a sum over sequences no longer shows each one's window."""
    per_layer_token = kv_bytes_per_token(model, cache_bytes) / model.num_layers
    num_global = model.num_layers - model.num_sliding_layers
    held = num_global * float(num_tokens) + model.num_sliding_layers * float(num_tokens_in_window)
    return held * per_layer_token


def kv_cache_bytes(
    model: ModelShape, context_len: int, batch: int, cache_bytes: float = 2.0
) -> float:
    """M_KV = 2·B·N·L·n_kv·d_head·s (§5)."""
    return batch * kv_bytes_per_sequence(model, context_len, cache_bytes)


def attention_decode_intensity(model: ModelShape, cache_bytes: float = 2.0) -> float:
    """I_attn, decode = 2g/s: the group size is decode attention's intensity (§6)."""
    return 2 * model.group_size / cache_bytes


# --- §8 the inference memory ledger -----------------------------------------------------


def weight_bytes_total(model: ModelShape, weight_bytes: float = 2.0) -> float:
    """M_weights = P·s_w, one copy (§8)."""
    return model.num_params * weight_bytes


def logits_bytes(num_rows: int, vocab_size: int, elem_bytes: float = 4.0) -> float:
    """The logits tensor rows·V·s (§8): the one activation term that can surprise you."""
    return float(num_rows) * vocab_size * elem_bytes


@dataclass(frozen=True)
class MemoryLedger:
    """M_inference = M_weights + M_KV + M_activations + M_workspace (§8), in bytes."""

    weights: float
    kv_cache: float
    activations: float
    workspace: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.workspace


def memory_ledger(
    model: ModelShape,
    context_len: int,
    batch: int,
    weight_bytes: float = 2.0,
    cache_bytes: float = 2.0,
    workspace_bytes: float = 2e9,
) -> MemoryLedger:
    """The decode-time ledger; activations are the last-position fp32 logits (§8)."""
    return MemoryLedger(
        weights=weight_bytes_total(model, weight_bytes),
        kv_cache=kv_cache_bytes(model, context_len, batch, cache_bytes),
        activations=logits_bytes(batch, model.vocab_size),
        workspace=workspace_bytes,
    )


def crossover_tokens(
    model: ModelShape, weight_bytes: float = 2.0, cache_bytes: float = 2.0
) -> float:
    """(B·N)_× = P·s_w / (2·L·n_kv·d_head·s_c): cached tokens where M_KV = M_weights (§8)."""
    return weight_bytes_total(model, weight_bytes) / kv_bytes_per_token(model, cache_bytes)


# --- §10, §16 the decode wall and tensor parallelism -----------------------------------


def cache_shards(model: ModelShape, tp: int) -> int:
    """Ranks the cache splits over: min(n, n_kv); past n_kv it is replicated (§16).

    An MLA latent is shared by all heads, so it cannot be split by head at all.
    """
    return 1 if model.kv_lora_rank is not None else min(tp, model.num_kv_heads)


def decode_step_time(
    model: ModelShape,
    accel: Accelerator,
    context_len: int,
    batch: int = 1,
    weight_bytes: float = 2.0,
    cache_bytes: float = 2.0,
    tp: int = 1,
) -> float:
    """t_step ≈ (s_w·P + B·M_KV/seq)/(n·β) + 2L·t_all-reduce (§10, §16).

    Weights shard n ways, the cache only min(n, n_kv) ways; each layer pays two
    latency-bound all-reduces once n > 1.
    """
    beta = accel.mem_bandwidth
    weights = weight_bytes_total(model, weight_bytes) / (tp * beta)
    cache = batch * kv_bytes_per_sequence(model, context_len, cache_bytes)
    cache /= cache_shards(model, tp) * beta
    collectives = 2 * model.num_layers * accel.allreduce_latency_s if tp > 1 else 0.0
    return weights + cache + collectives


# --- §11 what batching buys -------------------------------------------------------------


def b_star(accel: Accelerator, weight: Precision) -> float:
    """B* = s_w·π/(2β): batch where the weight read turns compute-bound (§11).

    π is the peak of the format the GEMMs run in, so W8A8 fp8 leaves B* where bf16 had it.
    """
    return (
        weight.bytes_per_element
        * accel.peak_flops(weight.compute_dtype)
        / (2 * accel.mem_bandwidth)
    )


def b_cross(
    model: ModelShape,
    context_len: int,
    weight_bytes: float = 2.0,
    cache_bytes: float = 2.0,
    tp: int = 1,
) -> float:
    """Batch where a step's cache bytes overtake its weight bytes, per device (§11)."""
    per_device_weights = weight_bytes_total(model, weight_bytes) / tp
    per_device_kv = kv_bytes_per_sequence(model, context_len, cache_bytes) / cache_shards(model, tp)
    return per_device_weights / per_device_kv


def b_max(
    model: ModelShape,
    accel: Accelerator,
    context_len: int,
    weight_bytes: float = 2.0,
    cache_bytes: float = 2.0,
    workspace_bytes: float = 2e9,
    tp: int = 1,
) -> int:
    """Sequences whose caches fit beside the weights and the workspace (Lab 3); 0 if none."""
    free = accel.memory_bytes - weight_bytes_total(model, weight_bytes) / tp - workspace_bytes
    per_seq = kv_bytes_per_sequence(model, context_len, cache_bytes) / cache_shards(model, tp)
    return max(0, math.floor(free / per_seq))


def decode_intensity(
    model: ModelShape,
    context_len: int,
    batch: int,
    weight_bytes: float = 2.0,
    cache_bytes: float = 2.0,
) -> float:
    """I(B) = B·(2P + 4·L·N·d) / (s_w·P + B·2·L·n_kv·d_head·s_c·N) (§11)."""
    work = batch * decode_flops(model, context_len)
    return work / decode_step_bytes(model, context_len, batch, weight_bytes, cache_bytes)


def intensity_ceiling(model: ModelShape, context_len: int, cache_bytes: float = 2.0) -> float:
    """I_∞(N) = (2P + 4·L·N·d)/M_KV/seq = 2P/M_KV/seq + 2g/s_c: I at infinite batch (§11)."""
    return decode_flops(model, context_len) / kv_bytes_per_sequence(model, context_len, cache_bytes)


def intensity_limit(model: ModelShape, cache_bytes: float = 2.0) -> float:
    """I_∞∞ = 2g/s_c: infinite batch and context; nothing but the cache's shape (§11)."""
    return attention_decode_intensity(model, cache_bytes)


def throughput_ceiling(
    model: ModelShape,
    accel: Accelerator,
    context_len: int,
    cache_bytes: float = 2.0,
    tp: int = 1,
) -> float:
    """Aggregate tok/s as B → ∞: β / M_KV/seq, times the ranks the cache splits over (§11)."""
    kv_seq = kv_bytes_per_sequence(model, context_len, cache_bytes)
    return cache_shards(model, tp) * accel.mem_bandwidth / kv_seq


# --- §13 metrics ----------------------------------------------------------------------


def e2e_latency(ttft_s: float, tpot_s: float, num_output_tokens: int) -> float:
    """E2E = TTFT + (N_o − 1)·TPOT (§13)."""
    return ttft_s + max(0, num_output_tokens - 1) * tpot_s


def littles_law_concurrency(arrival_rate: float, time_in_system_s: float) -> float:
    """Requests (and caches) in flight = arrival rate × average time in system (§13)."""
    return arrival_rate * time_in_system_s


# --- §15 speculative decoding -----------------------------------------------------------


def spec_expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens per verification] = (1 − α^(γ+1)) / (1 − α) (§15)."""
    assert 0 <= alpha <= 1 and gamma >= 0, f"need 0<=alpha<=1, gamma>=0: {alpha}, {gamma}"
    if alpha == 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def spec_speedup(alpha: float, gamma: int, draft_cost: float) -> float:
    """speed-up ≈ E[tokens] / (1 + γ·c), c = one draft step over one target step (§15)."""
    return spec_expected_tokens(alpha, gamma) / (1 + gamma * draft_cost)


def can_speculate(batch: int, gamma: int, b_star_value: float) -> bool:
    """Verification stays free while B(γ+1) ≤ B*; past the ridge rejections cost time (§15)."""
    return batch * (gamma + 1) <= b_star_value


# --- §16 mixture of experts -----------------------------------------------------------


def moe_distinct_experts(num_experts: int, experts_per_token: int, batch: int) -> float:
    """E[distinct experts read] = E·(1 − (1 − k/E)^B) under uniform routing (§16)."""
    return num_experts * (1 - (1 - experts_per_token / num_experts) ** batch)


# --- NanoFlow §3.2 ----------------------------------------------------------------------


def nanoflow_t_mem(mem_size_bytes: float, mem_bandwidth: float) -> float:
    """T_mem = MemSize / MemBW: one pass over all of memory (weights + KV)."""
    return mem_size_bytes / mem_bandwidth


def nanoflow_t_compute(b_dense: int, num_params: float, compute_flops: float) -> float:
    """T_compute ≈ 2·B_dense·P_model / Compute: the dense GEMMs of one iteration."""
    return 2 * b_dense * num_params / compute_flops


def nanoflow_t_net(
    num_gpus: int,
    b_dense: int,
    d_model: int,
    elem_bytes: float,
    num_layers: int,
    net_bandwidth: float,
) -> float:
    """T_net ≈ 4·N_GPU·B_dense·D_model·S_type·L / NetBW: the collectives of one iteration."""
    return 4 * num_gpus * b_dense * d_model * elem_bytes * num_layers / net_bandwidth


def nanoflow_tr(
    mem_size_bytes: float,
    mem_bandwidth: float,
    b_dense: int,
    num_params: float,
    compute_flops: float,
) -> float:
    """TR = T_mem / T_compute; below 1 the iteration is compute-bound (NanoFlow Eq. 4)."""
    return nanoflow_t_mem(mem_size_bytes, mem_bandwidth) / nanoflow_t_compute(
        b_dense, num_params, compute_flops
    )


def optimal_throughput(compute_flops: float, num_params: float) -> float:
    """Throughput_optimal = Compute / (2·P_model) tokens/s (NanoFlow Eq. 5)."""
    return compute_flops / (2 * num_params)

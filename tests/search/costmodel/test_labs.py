"""Labs 1–3 as records: the article's Lab numbers through the composed functions."""

import pytest

from search.costmodel.labs import batching_limits, kv_report, serving_plan
from search.costmodel.presets import ACCELERATORS, CACHE_PRECISIONS, MODELS, WEIGHT_PRECISIONS

H100 = ACCELERATORS["h100-sxm"]
LLAMA3_8B = MODELS["llama-3-8b"]
BF16_W, INT4_W = WEIGHT_PRECISIONS["bf16"], WEIGHT_PRECISIONS["int4"]
BF16_C, FP8_C = CACHE_PRECISIONS["bf16"], CACHE_PRECISIONS["fp8"]


def within3(expected: float):
    return pytest.approx(expected, rel=0.03)


def test_lab1_kv_report_llama2_at_128k():
    # §5: "A single Llama-2-7B-shaped sequence at full context needs 68.7 GB of KV cache —
    #      more than five times the model's own bf16 weights, and more than an 80 GB H100
    #      has left after loading them."
    r = kv_report(MODELS["llama-2-7b"], H100, 131072, 1, BF16_W, BF16_C)
    assert r.kv_bytes_per_sequence == within3(68.7e9)
    assert r.kv_bytes_per_sequence > 5 * r.weight_bytes
    assert r.max_concurrency == 0 and r.device_fraction_used > 1


def test_lab1_cache_precision_changes_cache_not_weights():
    # Lab 1: "Weight precision changes the weight bar but not the cache; cache precision
    #         changes the cache but not the weights."
    base = kv_report(LLAMA3_8B, H100, 8192, 8, BF16_W, BF16_C)
    fp8 = kv_report(LLAMA3_8B, H100, 8192, 8, BF16_W, FP8_C)
    int4 = kv_report(LLAMA3_8B, H100, 8192, 8, INT4_W, BF16_C)
    assert fp8.weight_bytes == base.weight_bytes and fp8.kv_bytes_total == base.kv_bytes_total / 2
    assert int4.kv_bytes_total == base.kv_bytes_total and int4.weight_bytes == base.weight_bytes / 4
    assert base.kv_bytes_total == within3(8 * 1.07e9)  # Table 3: "1.07 GB × B"


@pytest.mark.parametrize(
    "context,cross,ceiling", [(2048, 60, 12_500), (8192, 15, 3_120), (32768, 3.7, 780)]
)
def test_lab3_batching_limits_match_table4(context, cross, ceiling):
    r = batching_limits(LLAMA3_8B, H100, context, BF16_W, BF16_C)
    assert r.b_star == within3(295)
    assert r.b_cross == within3(cross)
    assert r.throughput_ceiling == within3(ceiling)
    assert r.intensity_at_b_max < r.intensity_ceiling


def test_lab3_b_max_57_at_8k():
    # §11 TRAP: "the cache overtakes the weights at batch 15 and the device runs out of
    #            memory at batch 57"; Lab 3 assumes 2 GB of workspace.
    r = batching_limits(LLAMA3_8B, H100, 8192, BF16_W, BF16_C, workspace_bytes=2e9)
    assert r.b_max == 57
    assert r.nanoflow_tr_at_b_max is not None


def test_lab3_nothing_fits():
    r = batching_limits(MODELS["llama-3-70b"], H100, 8192, BF16_W, BF16_C)
    assert r.b_max == 0 and r.intensity_at_b_max is None and r.nanoflow_tr_at_b_max is None


def test_lab2_plan_composes_ttft_tpot_e2e():
    # §13: "E2E = TTFT + (N_o − 1) · TPOT"; §3: prefill at 45% of peak.
    p = serving_plan(LLAMA3_8B, H100, 8192, 256, 1, BF16_W, BF16_C)
    assert p.fits
    assert p.ttft_s == within3(0.335)  # §3: 8,192-token prompt "≈ 335 ms"
    assert p.e2e_s == pytest.approx(p.ttft_s + 255 * p.tpot_s)
    assert p.tokens_per_s_total == pytest.approx(p.tokens_per_s_per_user)


def test_lab2_tp_past_n_kv_is_flagged_and_bad_tp_rejected():
    # Lab 2: "Tensor parallelism beyond n_kv cannot shard the cache further and is flagged"
    p = serving_plan(MODELS["llama-3-70b"], H100, 2048, 256, 16, BF16_W, BF16_C, tp=16)
    assert p.cache_replicated
    assert not serving_plan(LLAMA3_8B, H100, 2048, 256, 16, BF16_W, BF16_C, tp=8).cache_replicated
    with pytest.raises(ValueError, match="divide"):
        serving_plan(LLAMA3_8B, H100, 2048, 256, 16, BF16_W, BF16_C, tp=3)


def test_lab2_kv_share_passes_half_past_b_cross():
    # §8: past the crossover "more than half of the bytes moved on every decode step belong
    #     to the cache"; at 8k B_cross is 15 (Table 4).
    below = serving_plan(LLAMA3_8B, H100, 8192, 2, 8, BF16_W, BF16_C)
    above = serving_plan(LLAMA3_8B, H100, 8192, 2, 32, BF16_W, BF16_C)
    assert below.kv_share_of_step_bytes < 0.5 < above.kv_share_of_step_bytes

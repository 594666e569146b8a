"""search/sim/step_time.py against a hand computation and against §17's numbers."""

import dataclasses

import pytest

from search.costmodel import cost_model as cm
from search.costmodel.presets import ACCELERATORS, ENCODERS, MODELS, Accelerator, ModelShape
from search.image_budget import ImageAssumptions
from search.sim.step_time import (
    MeasuredStepCost,
    StepHardware,
    StepWork,
    chunk_attention_pairs,
    count_work,
    fit_step_cost,
    kv_layers_per_block,
    kv_pool_blocks,
    kv_windows,
    step_time,
)

H100 = StepHardware(MODELS["mha-7b"], ENCODERS["siglip-so400m-14-384"], ACCELERATORS["h100-sxm"])


def within3(expected: float):
    return pytest.approx(expected, rel=0.03)


def test_hand_computation():
    model = ModelShape("toy", 2, 64, 4, 4, 16, 128, 100, num_params_override=1e9)
    accel = Accelerator("toy", 100e9, 1e11, 1e12)
    hw = StepHardware(model, ENCODERS["siglip-base-16-224"], accel)
    # 100-token prefill from scratch plus 3 decodes at contexts 10, 20, 30.
    pairs = chunk_attention_pairs(0, 100) + sum(chunk_attention_pairs(c, 1) for c in (10, 20, 30))
    assert pairs == 100 * 100 + 11 + 21 + 31
    work = StepWork(100, 3, pairs, 100 + 11 + 21 + 31, 0)
    t = step_time(work, hw)
    flops = 2 * 1e9 * 103 + 4 * 2 * 64 * pairs
    assert t.compute_s == pytest.approx(flops / (1e12 * 0.45))
    kv_per_token = 2 * 2 * 4 * 16 * 2  # 2·L·n_kv·d_head·s
    assert t.memory_s == pytest.approx((2e9 + kv_per_token * 163) / 1e11)
    assert t.vit_s == 0 and t.total_s == pytest.approx(max(t.compute_s, t.memory_s))


def test_s17_one_image_step():
    # §17: ViT over 13 tiles ≈ 8.4 TFLOP ≈ 21 ms; LLM prefill over 2,400 tokens ≈ 82 ms.
    n = 2400
    t = step_time(StepWork(n, 0, chunk_attention_pairs(0, n), n, 13), H100)
    assert t.vit_s == within3(0.021)
    assert t.compute_s == within3(0.082)
    assert t.total_s == within3(0.021 + 0.082)


def test_decode_step_is_the_weight_read():
    # §10: a batch-1 decode step reads the weights once: 14 GB / 3.35 TB/s ≈ 4.2 ms.
    t = step_time(StepWork(0, 1, 100, 100, 0), H100)
    assert t.memory_s > t.compute_s
    assert t.total_s == within3(14e9 / 3.35e12)


def test_empty_and_vit_only_steps():
    assert step_time(StepWork(), H100).total_s == 0
    only_vit = step_time(StepWork(num_tiles_encoded=13), H100)
    assert only_vit.total_s == only_vit.vit_s > 0


def test_pool_holds_about_fifty_single_image_conversations():
    # §17: ~63 GB free beside the 7B backbone and the tower: about 50 × 2,400 tokens.
    num_blocks = kv_pool_blocks(H100, 16)
    assert num_blocks * 16 / 2400 == within3(50)


def test_pool_refuses_a_device_too_small():
    tiny = StepHardware(H100.model, H100.encoder, Accelerator("tiny", 1e9, 1e12, 1e12))
    with pytest.raises(ValueError, match="no KV cache"):
        kv_pool_blocks(tiny, 16)
    more_workspace = ImageAssumptions(workspace_bytes=10e9)
    hw = StepHardware(H100.model, H100.encoder, H100.accel, more_workspace)
    assert kv_pool_blocks(H100, 16) > kv_pool_blocks(hw, 16)


def test_a_hybrid_pool_counts_blocks_of_one_kv_cache_group():
    """Gemma 3 4B: 5 global and 29 sliding layers make a global group and six sliding ones
    of 5 layers (the last 4); a pool block holds 5 layers, so 34/5 as many fit."""
    gemma = MODELS["gemma-3-4b"]
    assert kv_windows(gemma) == (None,) + (1024,) * 6 and kv_layers_per_block(gemma) == 5
    assert kv_windows(MODELS["mha-7b"]) == (None,) and kv_layers_per_block(MODELS["mha-7b"]) == 32
    hw = StepHardware(gemma, ENCODERS["siglip-so400m-14-896"], ACCELERATORS["h100-sxm"])
    everything = dataclasses.replace(gemma, num_sliding_layers=0, sliding_window=None)
    plain = StepHardware(everything, hw.encoder, hw.accel)
    assert kv_pool_blocks(hw, 16) / kv_pool_blocks(plain, 16) == pytest.approx(34 / 5, rel=1e-3)


MEASURED = MeasuredStepCost(2e-3, 3e-4, 2e-5, 1e-8, 1.5e-3)


def some_steps() -> list[StepWork]:
    """Prefill-only, decode-only, mixed and tower steps of varied sizes."""
    works = []
    for n in (8, 50, 120, 400):
        works.append(StepWork(n, 0, chunk_attention_pairs(0, n), n, 0, 1))
    for seqs in (1, 4, 16, 32):
        works.append(StepWork(0, seqs, seqs * 60, seqs * 60, 0, seqs))
    for seqs, n, tiles in ((3, 117, 13), (9, 40, 0), (1, 117, 13), (5, 200, 4), (2, 9, 1)):
        pairs = chunk_attention_pairs(30, n) + (seqs - 1) * 90
        works.append(StepWork(n, seqs - 1, pairs, 30 + n + (seqs - 1) * 90, tiles, seqs))
    return works


def test_measured_cost_replaces_the_roofline():
    hw = StepHardware(H100.model, H100.encoder, H100.accel, measured=MEASURED)
    work = StepWork(100, 3, 10_000, 400, 13, 4)
    t = step_time(work, hw)
    assert t.vit_s == pytest.approx(13 * 1.5e-3)
    assert t.total_s == pytest.approx(2e-3 + 4 * 3e-4 + 103 * 2e-5 + 1e4 * 1e-8 + 13 * 1.5e-3)
    assert step_time(StepWork(), hw).total_s == 0  # nothing to run costs nothing
    with pytest.raises(ValueError, match=">= 0"):
        MeasuredStepCost(1e-3, -1e-4, 0, 0, 0)


def test_fit_recovers_the_coefficients_of_exact_samples():
    hw = StepHardware(H100.model, H100.encoder, H100.accel, measured=MEASURED)
    samples = [(w, step_time(w, hw).total_s) for w in some_steps()]
    fitted = fit_step_cost(samples)
    for name in ("per_step_s", "per_seq_s", "per_row_s", "per_pair_s", "per_tile_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(MEASURED, name), rel=1e-6), name


def test_fit_leaves_out_a_stalled_step_but_keeps_slow_long_ones():
    hw = StepHardware(H100.model, H100.encoder, H100.accel, measured=MEASURED)
    samples = [(w, step_time(w, hw).total_s) for w in some_steps()] * 3
    noisy = [(w, t * (1.02 if i % 2 else 0.98)) for i, (w, t) in enumerate(samples)]
    clean = fit_step_cost(noisy)
    assert clean.per_step_s == pytest.approx(MEASURED.per_step_s, rel=0.1)
    assert clean.per_tile_s == pytest.approx(MEASURED.per_tile_s, rel=0.1)
    # One decode step that took 5 s, or twice its time: left out, the fit is the one
    # without it (kept, it moves the terms by 0.01-4%: the relative error bounds a stall).
    decode = some_steps()[4]
    for seconds in (5.0, 2 * step_time(decode, hw).total_s):
        fitted = fit_step_cost([*noisy, (decode, seconds)])
        for name in ("per_step_s", "per_seq_s", "per_row_s", "per_pair_s", "per_tile_s"):
            assert getattr(fitted, name) == pytest.approx(getattr(clean, name), rel=1e-9), name
    # Every tower step a third slower (contention, not a stall): that is their cost.
    slow = [(w, t * (1.33 if w.num_tiles_encoded else 1.0)) for w, t in noisy]
    assert fit_step_cost(slow).per_tile_s > 1.2 * MEASURED.per_tile_s


def test_fit_drops_a_term_that_would_be_negative():
    # Steps that get cheaper with more attention pairs: the pair term is 0, not negative.
    samples = [(w, 1e-3 + 1e-5 * w.num_dense_rows - 1e-9 * w.num_attention_pairs)
               for w in some_steps()]  # fmt: skip
    fitted = fit_step_cost(samples)
    assert fitted.per_pair_s == 0
    assert min(dataclasses.astuple(fitted)) >= 0
    with pytest.raises(ValueError, match="at least 5"):
        fit_step_cost(samples[:4])


def test_a_timed_tower_sets_the_tile_term_and_the_rest_fits_the_remainder():
    hw = StepHardware(H100.model, H100.encoder, H100.accel, measured=MEASURED)
    works = some_steps() * 3
    tower = [step_time(w, hw).vit_s for w in works]
    # The rest of every tower step 40% slower than the model (their prefill rows under
    # contention): a joint fit would give part of that to the tile term, which the
    # tower's own timing does not take.
    seconds = [
        step_time(w, hw).vit_s + (step_time(w, hw).total_s - step_time(w, hw).vit_s)
        * (1.4 if w.num_tiles_encoded else 1.0) for w in works
    ]  # fmt: skip
    samples = list(zip(works, seconds, strict=True))
    timed = fit_step_cost(samples, tower_s=tower)
    assert timed.per_tile_s == pytest.approx(MEASURED.per_tile_s, rel=1e-9)
    assert fit_step_cost(samples).per_tile_s > 1.05 * MEASURED.per_tile_s
    # Exact samples: every coefficient back.
    exact = [(w, step_time(w, hw).total_s) for w in works]
    fitted = fit_step_cost(exact, tower_s=tower)
    for name in ("per_step_s", "per_seq_s", "per_row_s", "per_pair_s", "per_tile_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(MEASURED, name), rel=1e-6), name
    with pytest.raises(ValueError, match="tower seconds"):
        fit_step_cost(exact, tower_s=[t + 1.0 for t in tower])  # longer than its step


GEMMA = StepHardware(MODELS["gemma-3-4b"], ENCODERS["siglip-so400m-14-896"], H100.accel)
# A prefill chunk crossing the window, a chunk inside it, decodes inside and past it.
CHUNKS = [(600, 700, False), (0, 300, False), (100, 1, True), (8191, 1, True)]


def test_a_model_without_sliding_layers_prices_as_before():
    """mha-7b: the windowed counts change nothing, bit for bit, against the formula the
    simulator priced every step with before it counted windows."""
    model, a = H100.model, H100.assumptions
    for window in (None, 1024):
        work = count_work(CHUNKS, 13, window)
        t = step_time(work, H100)
        flops = 2 * model.num_params * work.num_dense_rows
        flops += 4 * model.num_layers * model.hidden_size * float(work.num_attention_pairs)
        kv = work.num_kv_tokens_read * cm.kv_bytes_per_token(model, 2.0)
        memory_s = (model.num_params * a.weight_bytes + kv) / H100.accel.mem_bandwidth
        assert t.compute_s == cm.compute_time(flops, H100.accel.flops_bf16, a.prefill_efficiency)
        assert t.memory_s == memory_s
        assert t == step_time(StepWork(*dataclasses.astuple(work)[:6]), H100)
    # A sliding-window model's work counted without its window: priced all global.
    bare = count_work(CHUNKS, 0, None)
    assert bare.num_kv_tokens_read_in_window is None
    assert step_time(bare, GEMMA).memory_s > step_time(count_work(CHUNKS, 0, 1024), GEMMA).memory_s


def test_a_gemma3_decode_at_8k_reads_the_hybrid_kv():
    """Gemma 3 4B, 4 sequences decoding at 8,192 tokens: KV read = the cost model's
    hybrid KV per sequence (5 global layers × 8,192 + 29 sliding × 1,024), about a
    quarter of all-global's; attention FLOPs split the same way."""
    model, a = GEMMA.model, GEMMA.assumptions
    work = count_work([(8191, 1, True)] * 4, 0, 1024)
    assert (work.num_kv_tokens_read, work.num_kv_tokens_read_in_window) == (4 * 8192, 4 * 1024)
    t = step_time(work, GEMMA)
    kv = t.memory_s * GEMMA.accel.mem_bandwidth - cm.weight_bytes_total(model, a.weight_bytes)
    assert kv == pytest.approx(4 * cm.kv_bytes_per_sequence(model, 8192), rel=1e-9)
    per_layer_token = 2 * model.num_kv_heads * model.head_dim * 2.0
    assert kv == pytest.approx(4 * (5 * 8192 + 29 * 1024) * per_layer_token, rel=1e-9)
    assert kv / (4 * cm.kv_bytes_all_global(model, 8192)) == pytest.approx(0.25, abs=0.01)
    flops = 2 * model.num_params * 4 + 4 * model.hidden_size * 4 * (5 * 8192 + 29 * 1024)
    assert t.compute_s == pytest.approx(flops / (GEMMA.accel.flops_bf16 * 0.45), rel=1e-9)


def brute_force_pairs(num_computed: int, num_new: int, window: int | None) -> int:
    """Row by row and key by key: every row of the chunk priced at the chunk's context
    (the full variant), a sliding layer's row seeing only the last `window` of its keys."""
    end = num_computed + num_new
    return sum(
        1 for _row in range(num_new) for key in range(end) if window is None or key >= end - window
    )


def test_window_pairs_of_a_chunk_crossing_the_window_match_a_count_over_rows():
    for c, n in [(600, 700), (0, 1500), (1023, 1), (5000, 1), (0, 300), (1024, 0)]:
        windowed = count_work([(c, n, False)], 0, 1024).num_attention_pairs_in_window
        assert windowed == brute_force_pairs(c, n, 1024), (c, n)
        assert chunk_attention_pairs(c, n) == brute_force_pairs(c, n, None)
    work = count_work(CHUNKS, 0, 1024)
    assert work.num_attention_pairs_in_window == sum(
        brute_force_pairs(c, n, 1024) for c, n, _ in CHUNKS
    )
    assert work.num_kv_tokens_read_in_window == 1024 + 300 + 101 + 1024
    # A window no chunk reaches: the windowed counts are the full ones.
    wide = count_work(CHUNKS, 0, 10_000)
    assert wide.num_attention_pairs_in_window == wide.num_attention_pairs
    assert wide.num_kv_tokens_read_in_window == wide.num_kv_tokens_read

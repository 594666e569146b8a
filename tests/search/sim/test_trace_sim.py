"""The trace simulator: the real scheduler on the cost model's clock; traces; metrics."""

import dataclasses
import random

import pytest

from scheduler.config import SloConfig
from search.costmodel.presets import ACCELERATORS, ENCODERS, MODELS
from search.image_budget import ImageAssumptions
from search.sim.capacity import Slo, find_max_rate, percentile, summarize
from search.sim.step_time import (
    MeasuredStepCost,
    StepHardware,
    StepWork,
    chunk_attention_pairs,
    step_time,
)
from search.sim.trace_sim import EncoderCacheModel, SimConfig, _Sim, simulate, step_cost_of
from search.sim.traces import (
    TraceImage,
    TraceRequest,
    lumpy_trace,
    make_mix,
    poisson_arrivals,
    read_jsonl,
    to_jsonl,
)

H100 = StepHardware(MODELS["mha-7b"], ENCODERS["siglip-so400m-14-384"], ACCELERATORS["h100-sxm"])
NO_WORKSPACE = ImageAssumptions(workspace_bytes=0)
BLOCK_BYTES = 16 * 512 * 1024  # mha-7b: 512 KiB per token


def small_pool(num_blocks: int) -> StepHardware:
    """H100 shapes with memory for exactly `num_blocks` KV blocks."""
    resident = (7.0e9 + 0.4e9) * 2
    accel = dataclasses.replace(H100.accel, memory_bytes=resident + num_blocks * BLOCK_BYTES + 1)
    return StepHardware(H100.model, H100.encoder, accel, NO_WORKSPACE)


def make_request(rid="r0", t=0.0, text=100, out=8, images=(), cls=None) -> TraceRequest:
    cls = cls or ("image" if images else "text")
    return TraceRequest(rid, t, cls, text, out, tuple(images), 0)


def by_id(result):
    return {r.request_id: r for r in result.records}


def test_one_text_request_times_match_the_step_model():
    rec = by_id(simulate([make_request(text=100, out=4)], H100))["r0"]
    prefill = step_time(StepWork(100, 0, chunk_attention_pairs(0, 100), 100, 0), H100).total_s
    decodes = [
        step_time(StepWork(0, 1, chunk_attention_pairs(c, 1), c + 1, 0), H100).total_s
        for c in (100, 101, 102)
    ]
    assert rec.ttft_s == pytest.approx(prefill)
    assert rec.e2e_s == pytest.approx(prefill + sum(decodes))
    assert rec.num_output_tokens == 4 and rec.tpot_s == pytest.approx(sum(decodes) / 3)


def test_measured_step_cost_and_a_given_pool_size():
    cost = MeasuredStepCost(2e-3, 3e-4, 2e-5, 1e-8, 1.5e-3)
    hw = dataclasses.replace(H100, measured=cost)
    result = simulate([make_request(text=100, out=3)], hw, SimConfig(num_blocks=40))
    assert result.num_blocks == 40
    rec = by_id(result)["r0"]
    assert rec.ttft_s == pytest.approx(2e-3 + 3e-4 + 100 * 2e-5 + 100 * 100 * 1e-8)
    decode = [2e-3 + 3e-4 + 2e-5 + c * 1e-8 for c in (101, 102)]
    assert rec.e2e_s == pytest.approx(rec.ttft_s + sum(decode))
    with pytest.raises(ValueError, match="num_blocks"):
        SimConfig(num_blocks=0)


def test_server_latency_on_each_side_of_the_engine():
    """Ingress delays when the scheduler (and the preprocessing pool) get a request; egress
    delays when the client gets each token. TPOT is unchanged."""
    hw = dataclasses.replace(H100, measured=MeasuredStepCost(2e-3, 0, 0, 0, 1e-3))
    reqs = [make_request("text", text=100, out=3),
            make_request("img", 1.0, text=10, out=2, images=[TraceImage("x", 2)])]  # fmt: skip
    plain = by_id(simulate(reqs, hw))
    late = by_id(simulate(reqs, hw, SimConfig(ingress_s=0.010, egress_s=0.004)))
    for rid in ("text", "img"):
        assert late[rid].ttft_s == pytest.approx(plain[rid].ttft_s + 0.014)
        assert late[rid].e2e_s == pytest.approx(plain[rid].e2e_s + 0.014)
        assert late[rid].tpot_s == pytest.approx(plain[rid].tpot_s)
    # The image's 2 tiles of preprocessing (1.2 ms each) start after the ingress.
    per_tile = hw.assumptions.preprocess_s_per_tile
    assert plain["img"].ttft_s == pytest.approx(2 * per_tile + 2e-3 + 2 * 1e-3)
    with pytest.raises(ValueError, match="ingress_s"):
        SimConfig(ingress_s=-1.0)


def test_ingress_per_image_delays_image_requests_by_their_image_count():
    hw = dataclasses.replace(H100, measured=MeasuredStepCost(2e-3, 0, 0, 0, 1e-3))
    two = [TraceImage("a", 2), TraceImage("b", 2)]
    reqs = [make_request("text", text=100, out=3),
            make_request("img", 1.0, text=10, out=2, images=two)]  # fmt: skip
    plain = by_id(simulate(reqs, hw, SimConfig(ingress_s=0.010)))
    late = by_id(simulate(reqs, hw, SimConfig(ingress_s=0.010, ingress_s_per_image=0.005)))
    assert late["text"].ttft_s == pytest.approx(plain["text"].ttft_s)
    assert late["img"].ttft_s == pytest.approx(plain["img"].ttft_s + 2 * 0.005)
    with pytest.raises(ValueError, match="ingress_s_per_image"):
        SimConfig(ingress_s_per_image=-1.0)


def test_one_image_ttft_is_s17s_118_ms():
    # §17: preprocess ≈ 15 ms + ViT ≈ 21 ms + prefill ≈ 82 ms: TTFT ≈ 118 ms. The prompt
    # (2,370 visual + 30 text tokens) goes in one step when the budget allows it.
    req = make_request(text=30, out=2, images=[TraceImage("photo", 13)])
    result = simulate([req], H100, SimConfig(max_num_batched_tokens=4096))
    assert by_id(result)["r0"].ttft_s == pytest.approx(0.118, rel=0.03)
    assert by_id(result)["r0"].num_prompt_tokens == 2400
    assert result.num_tiles_encoded == 13


def test_repeat_image_hits_encoder_and_prefix_cache():
    photo = TraceImage("photo", 13)
    first = make_request("a", 0.0, text=30, out=2, images=[photo])
    again = make_request("b", 5.0, text=30, out=2, images=[photo])
    result = simulate([first, again], H100)
    recs = by_id(result)
    assert result.num_tiles_encoded == 13  # the second question encodes nothing
    assert recs["b"].ttft_s < recs["a"].ttft_s / 10


def test_never_fits_is_refused_at_arrival_and_the_rest_finish():
    hw = small_pool(40)
    trace = [make_request("big", 0.0, text=100, out=40 * 16), make_request("ok", 0.1, out=8)]
    result = simulate(trace, hw)
    recs = by_id(result)
    assert recs["big"].refused and "KV blocks" in recs["big"].refused
    assert recs["big"].first_token_s is None
    assert recs["ok"].finish_s is not None
    assert result.num_lost == 0 and not result.hang


def test_preemption_recomputes_and_leaves_the_pool_clean():
    trace = [make_request(f"r{i}", 0.0, text=100, out=200) for i in range(8)]
    sim = _Sim(trace, small_pool(40), SimConfig())
    result = sim.run()
    assert result.num_preemptions > 0 and result.num_recomputed_tokens > 0
    assert result.num_lost == 0 and not result.hang
    assert all(r.num_output_tokens == 200 for r in result.records)
    bm = sim.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    assert max(f for _, f, _ in result.timeline) == pytest.approx(1.0, abs=0.05)


def test_a_sliding_window_model_counts_its_kv_cache_groups():
    """Gemma 3 4B in the simulator: the scheduler gets its KV cache groups (one global,
    six sliding over 1,024 positions), long requests decode with each sliding group inside
    its window, and the pool ends clean."""
    gemma = StepHardware(MODELS["gemma-3-4b"], ENCODERS["siglip-so400m-14-896"], H100.accel)
    trace = [make_request(f"r{i}", 0.01 * i, text=3000, out=1500) for i in range(4)]
    sim = _Sim(trace, gemma, SimConfig())
    bm = sim.scheduler.block_manager
    assert bm.windows == (None,) + (1024,) * 6
    peak_sliding = 0.0
    original = sim.sample_timeline

    def sample() -> None:  # the sliding groups' blocks at every timeline point
        nonlocal peak_sliding
        peak_sliding = max(peak_sliding, sim.scheduler.stats()["kv_blocks_in_use_sliding"])
        original()

    sim.sample_timeline = sample
    result = sim.run()
    assert result.num_lost == 0 and not result.hang
    assert all(r.num_output_tokens == 1500 for r in result.records)
    # Per request and sliding group: at most the window and one step's chunk (2,048), 194
    # blocks, where 4,500 tokens all global would be 282.
    per_request = -(-(1024 - 1 + 2048) // 16) + 1
    assert 0 < peak_sliding <= 4 * 6 * per_request
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_usable_blocks


def brute_force_work(chunks, window: int) -> StepWork:
    """A step's work counted row by row and key by key, with no help from `count_work` or
    `chunk_shape`: each chunk of (tokens computed before, new tokens, is a decode) prices
    every row at the chunk's whole context (the full variant), a sliding layer's row at
    the keys of its last `window` positions; a sequence reads its context, a sliding
    layer the window's part of it."""
    prefill = decode = pairs = kv = pairs_w = kv_w = 0
    for start, n, is_decode in chunks:
        end = start + n
        keys = range(end)
        in_window = [k for k in keys if k >= end - window]
        for _row in range(n):
            pairs += len(keys)
            pairs_w += len(in_window)
        kv, kv_w = kv + len(keys), kv_w + len(in_window)
        decode, prefill = (decode + n, prefill) if is_decode else (decode, prefill + n)
    return StepWork(prefill, decode, pairs, kv, 0, len(chunks), kv_w, pairs_w)


GEMMA_WINDOW = 1024  # Gemma 3 4B's sliding layers (its config.json's sliding_window)


def test_a_sliding_window_model_decodes_at_its_windowed_step_time():
    """Gemma 3 4B, one 8,000-token prompt: every decode step is priced with its sliding
    layers over the window (1,024 keys read and attended), under the all-global price.
    The reference counts each step's keys one by one (not by the simulator's count)."""
    gemma = StepHardware(MODELS["gemma-3-4b"], ENCODERS["siglip-so400m-14-896"], H100.accel)
    assert gemma.model.sliding_window == GEMMA_WINDOW
    rec = by_id(simulate([make_request(text=8000, out=4)], gemma))["r0"]
    windowed = [step_time(brute_force_work([(c, 1, True)], GEMMA_WINDOW), gemma).total_s
                for c in (8000, 8001, 8002)]  # fmt: skip
    all_global = [step_time(StepWork(0, 1, c + 1, c + 1, 0, 1), gemma).total_s
                  for c in (8000, 8001)]  # fmt: skip
    assert rec.tpot_s == pytest.approx(sum(windowed) / 3, rel=1e-12)
    assert rec.tpot_s < min(all_global)


def test_the_scheduler_prices_a_sliding_window_models_steps_as_the_clock_does():
    """Gemma 3 4B, prompts past the window decoding beside others' chunks, with a TPOT
    target (the guard prices the steps it plans): the shape the scheduler reports for
    every plan costs what the clock charges for it, and both are the price of the plan's
    work counted row by row and key by key (`brute_force_work`)."""
    gemma = StepHardware(MODELS["gemma-3-4b"], ENCODERS["siglip-so400m-14-896"], H100.accel)
    trace = [make_request(f"r{i}", 0.02 * i, text=3000, out=30) for i in range(6)]
    config = SimConfig(admission="lumpy", slo=SloConfig(tpot_s=0.05))
    sim = _Sim(trace, gemma, config)
    cost, pairs, original = step_cost_of(gemma), [], sim.step

    def step(plan) -> None:
        shape = sim.scheduler.step_shape(plan)
        chunks = []
        for item in plan.scheduled:
            start, n = item.num_computed_tokens, item.num_new_tokens
            prompt = sim.scheduler.seqs[item.request_id].num_prompt_tokens
            chunks.append((start, n, n == 1 and start >= prompt))
        brute = step_time(brute_force_work(chunks, GEMMA_WINDOW), gemma).total_s
        pairs.append((cost(shape), step_time(sim.price(plan), gemma).total_s, brute, shape))
        original(plan)

    sim.step = step
    assert sim.run().num_lost == 0
    for guard, clock, brute, shape in pairs:
        assert guard == pytest.approx(brute, rel=1e-12), shape
        assert clock == pytest.approx(brute, rel=1e-12), shape
    windowed = [s for *_, s in pairs if s.num_kv_tokens_read_in_window is not None]
    assert len(windowed) == len(pairs)
    assert any(s.num_kv_tokens_read_in_window < s.num_kv_tokens_read for s in windowed)
    # Steps with a chunk or context past the window, and both kinds of row, were priced.
    assert any(s.num_prefill_tokens and s.num_decode_rows for s in windowed)


def test_same_trace_same_result():
    trace = make_mix("vlm", 60, 4.0, seed=3)
    a, b = simulate(trace, H100), simulate(trace, H100)
    assert [(r.request_id, r.finish_s) for r in a.records] == [
        (r.request_id, r.finish_s) for r in b.records
    ]


def test_an_unknown_admission_or_option_is_refused_by_name():
    for admission in ("fcfs", "lumpy"):
        result = simulate([make_request()], H100, SimConfig(admission=admission))
        assert result.num_lost == 0
    with pytest.raises(ValueError, match="'nope'"):
        simulate([make_request()], H100, SimConfig(admission="nope"))
    with pytest.raises(ValueError, match="no_such_option"):
        simulate([make_request()], H100, SimConfig(scheduler_options=(("no_such_option", 1),)))


def test_encoder_cache_is_an_lru_under_a_byte_budget():
    cache = EncoderCacheModel(100)
    cache.insert(b"a", 60)
    cache.insert(b"b", 30)
    cache.insert(b"a", 60)  # touch: b is now the oldest
    cache.insert(b"c", 30)
    assert cache.contains(b"a") and cache.contains(b"c") and not cache.contains(b"b")
    cache.insert(b"huge", 101)
    assert not cache.contains(b"huge")


# --- traces ---------------------------------------------------------------------------


def test_poisson_rate_and_mix_classes():
    times = poisson_arrivals(10.0, 5000, random.Random(0))
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.05)
    trace = make_mix("vlm", 2000, 5.0, seed=1)
    classes = {r.request_class for r in trace}
    assert classes == {"text", "image", "multi-image", "repeat-image"}
    tiles = [im.num_tiles for r in trace for im in r.images]
    assert min(tiles) == 1 and max(tiles) == 13
    assert max(len(r.images) for r in trace) == 4
    assert trace == make_mix("vlm", 2000, 5.0, seed=1)


def test_lumpy_trace_has_its_burst_and_never_fits():
    trace = lumpy_trace(5.0, 20.0, 5.0, 6, 1.0, seed=0, num_never_fits=2)
    burst = [r for r in trace if r.request_class == "4x13-tile"]
    assert len(burst) == 6 and all(5.0 <= r.arrival_s <= 6.0 for r in burst)
    assert all(len(r.images) == 4 and r.images[0].num_tiles == 13 for r in burst)
    assert sum(r.request_class == "never-fits" for r in trace) == 2
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)


def test_lumpy_trace_bursts_recur_with_new_images_and_one_burst_is_unchanged():
    one = lumpy_trace(5.0, 20.0, 5.0, 6, 1.0, seed=0, num_never_fits=2)
    assert lumpy_trace(5.0, 20.0, 5.0, 6, 1.0, seed=0, num_never_fits=2, num_bursts=1) == one
    three = lumpy_trace(5.0, 30.0, 2.0, 6, 1.0, seed=0, num_bursts=3, burst_period_s=10.0)
    burst = [r for r in three if r.request_class == "4x13-tile"]
    assert len(burst) == 18
    for k, start in enumerate((2.0, 12.0, 22.0)):
        assert sum(start <= r.arrival_s <= start + 1.0 for r in burst) == 6, k
    hashes = [im.content_hash for r in burst for im in r.images]
    assert len(set(hashes)) == len(hashes) == 72
    assert len({r.request_id for r in three}) == len(three)
    text = [r for r in three if r.request_class == "text"]
    single = lumpy_trace(5.0, 30.0, 2.0, 6, 1.0, seed=0)
    assert text == [r for r in single if r.request_class == "text"]  # the same chat
    with pytest.raises(ValueError, match="num_bursts"):
        lumpy_trace(5.0, 30.0, 2.0, 6, 1.0, num_bursts=0)


def test_jsonl_round_trip_and_errors(tmp_path):
    trace = make_mix("vlm", 30, 2.0, seed=2)
    path = tmp_path / "trace.jsonl"
    path.write_text(to_jsonl(trace))
    assert read_jsonl(path) == trace
    path.write_text('{"arrival_s": 0, "text_tokens": 5}\n')
    with pytest.raises(ValueError, match="line 1.*max_tokens"):
        read_jsonl(path)
    with pytest.raises(ValueError, match="unknown mix"):
        make_mix("nope", 10, 1.0)


# --- metrics --------------------------------------------------------------------------


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99


def test_summary_counts_and_goodput():
    trace = [make_request(f"r{i}", i * 0.5, out=16) for i in range(10)]
    s = summarize(simulate(trace, H100), Slo(ttft_s=1.0, tpot_s=0.05))
    assert s.slo_attainment == 1.0 and s.num_lost == 0 and s.num_refused == 0
    assert s.classes[-1].request_class == "all" and s.classes[-1].num_finished == 10
    assert s.goodput_rps == pytest.approx(10 / s.duration_s)
    strict = summarize(simulate(trace, H100), Slo(ttft_s=1e-4, tpot_s=0.05))
    assert strict.goodput_rps == 0 and strict.slo_attainment == 0


def test_find_max_rate_brackets_the_slo():
    hw = small_pool(400)

    def trace_at(rate: float):
        return make_mix("chat", 40, rate, seed=0)

    slo = Slo(ttft_s=0.05, tpot_s=0.05)
    found = find_max_rate(trace_at, hw, SimConfig(), slo, 0.9, iterations=5)
    assert 0 < found.max_rate < 64
    ok = [r for r, attained in found.tried if attained >= 0.9]
    assert found.max_rate == max(ok)

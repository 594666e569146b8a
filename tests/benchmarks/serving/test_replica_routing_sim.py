"""The simulated routing benchmark: parameters chosen on some seeds, reported on others,
and each run a function of its seed."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.serving import replica_routing_sim as bench
from scheduler.routing.policy import RouterConfig
from search.sim.traces import TraceImage, TraceRequest


def args(**kw) -> argparse.Namespace:
    base = dict(requests_per_replica=15, max_requests=6000, rate_per_replica=8.0,
                encoder_cache_mb=256.0, max_imbalance=2, no_oracle=False, min_requests=0,
                no_cache_model=False)  # fmt: skip
    return argparse.Namespace(**base | kw)


def figures(run: dict) -> dict:
    return {k: {m: v for m, v in r.items() if m != "sim_wall_s"} for k, r in run["routers"].items()}


def test_reported_seeds_are_held_out_and_the_chosen_parameters_are_the_defaults():
    assert not set(bench.TUNING_SEEDS) & set(bench.HELD_OUT_SEEDS)
    defaults = RouterConfig()
    assert {k: getattr(defaults, k) for k in bench.CHOSEN} == bench.CHOSEN


@pytest.mark.slow
def test_a_run_is_a_function_of_its_seed_and_the_oracle_is_the_ceiling():
    a, b = bench.run(2, 3, args(), bench.CHOSEN), bench.run(2, 3, args(), bench.CHOSEN)
    assert figures(a) == figures(b)
    other = bench.run(2, 4, args(), bench.CHOSEN)
    assert figures(other) != figures(a)
    hit = "encoder_cache_hit_rate"
    for run in (a, other):
        assert run["routers"]["oracle"][hit] >= run["routers"]["cache_aware"][hit]
        assert run["compulsory_hit_rate"] >= run["routers"]["oracle"][hit]


def test_the_compulsory_ceiling_counts_every_later_sight_a_hit():
    x, y = (TraceImage("x", 1),), (TraceImage("y", 1),)
    trace = [
        TraceRequest(f"r{i}", float(i), "image", 8, 4, im) for i, im in enumerate([x, y, x, x])
    ]
    assert bench.compulsory_hit_rate(trace) == 0.5  # x, y first; x twice again


def test_the_real_benchmarks_trace_keeps_the_simulators_images_per_request():
    from benchmarks.serving import replica_routing as real

    assert bench.num_requests(2, args(min_requests=3000)) == bench.MIN_REQUESTS == 3000
    # Ours knows a replica's encoder cache: 256 MiB of Qwen2-7B's 3584-wide bf16 tokens.
    assert bench.ours(args(), bench.CHOSEN).encoder_cache_tokens == 256 * 2**20 // (3584 * 2)
    assert bench.ours(args(no_cache_model=True), bench.CHOSEN).encoder_cache_tokens is None
    small = real.shape(120)
    assert small.num_images == 12  # 300 images per 3000 requests
    same = ("pool_share", "unique_share", "zipf_s", "followup_share", "max_turns")
    assert all(getattr(small, k) == getattr(bench.SHAPE, k) for k in same)
    assert real.images_per_cache(256) > 1000  # the default cache holds every scene of a run

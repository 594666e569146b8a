"""Stage I and Stage II MILPs on hand-made profiles whose optimum is worked out by hand,
and the auto-search's schedules through the independent checker."""

import random

import pytest

from search.costmodel.presets import ModelShape, get_accelerator, get_model
from search.nanoflow.auto_search import (
    STREAMS,
    best_partitioning,
    cached_schedule,
    schedule_cost_us,
    search_schedule,
)
from search.nanoflow.milp import solve_stage1, split_groups
from search.nanoflow.milp_stage2 import solve_stage2
from search.nanoflow.op_graph import PARTITIONINGS, BatchMix, layer_ops
from search.nanoflow.profiles import TABLE3_KNOTS, OpProfile, Profiles, synthetic_gpu_profiles
from search.nanoflow.schedule import NanoOp, Schedule, check


def _profiles(per_granule: dict[str, tuple[str, float]], granules: int, knots=None) -> Profiles:
    """Ops whose time is linear in rows: `us` microseconds per 128 rows."""
    counts = tuple(128 * m for m in range(1, granules + 1))
    ops = tuple(
        OpProfile(op, res, counts, tuple(us * m for m in range(1, granules + 1)))
        for op, (res, us) in per_granule.items()
    )
    return Profiles("hand", "hand", 128, ops, knots or dict(TABLE3_KNOTS), "synthetic")


def _sizes(result, op):
    return [n.row_end - n.row_start for n in result.nanos if n.op == op]


def test_stage1_finds_the_hand_computed_split():
    # qkv (compute) 10 us per 128 rows, then attention (memory) 30 us per 128 rows, 512
    # rows in two nano-batches each. qkv = (a, 4-a) granules, attention = (c, 4-c):
    # attention's first part can start after qkv's first only if c <= a, and then the
    # layer lasts max(40, 10a + 30c) + 30(4 - c); c > a gives 160. Best: a = c = 1, 130 us
    # (unsplit: 40 + 120 = 160).
    profiles = _profiles({"qkv": ("compute", 10.0), "attention": ("memory", 30.0)}, 4)
    result = solve_stage1(profiles, 512, {"qkv": 2, "attention": 2})
    assert result.status == "optimal"
    assert result.makespan_us == pytest.approx(130.0)
    assert _sizes(result, "qkv") == [128, 384] and _sizes(result, "attention") == [128, 384]


def test_stage1_never_overlaps_one_resource():
    # Two compute ops: nothing can run beside anything, the layer is their sum.
    profiles = _profiles({"qkv": ("compute", 10.0), "o_proj": ("compute", 20.0)}, 4)
    result = solve_stage1(profiles, 512, {"qkv": 2, "o_proj": 2})
    assert result.makespan_us == pytest.approx(40.0 + 80.0)
    spans = sorted((n.start_us, n.start_us + n.duration_us) for n in result.nanos)
    assert all(b[0] >= a[1] - 1e-9 for a, b in zip(spans, spans[1:], strict=False))


def test_stage2_shares_match_table3_by_hand():
    # 256 rows, 10 us per 128 rows each: Stage I runs qkv[128:] beside attention[:128]
    # (30 us). Under Table 3, sharing R and 1 - R takes 10 max(1/R, 1/P(1 - R)), least
    # where R = P(1 - R) = 0.3 + (0.8 - R)·0.55/0.6: R = 0.539, 18.55 us, and the layer
    # 38.55 us: better than running the two one after the other (40 us).
    profiles = _profiles({"qkv": ("compute", 10.0), "attention": ("memory", 10.0)}, 2)
    stage1 = solve_stage1(profiles, 256, {"qkv": 2, "attention": 2})
    assert stage1.makespan_us == pytest.approx(30.0)
    stage2 = solve_stage2(stage1, profiles)
    # The secant bound over a 0.1 grid of R leaves the optimum at most a little above.
    assert 38.55 <= stage2.makespan_us <= 38.55 * 1.02
    qkv1 = next(n for n in stage2.nanos if n.op == "qkv" and n.row_start == 128)
    attn0 = next(n for n in stage2.nanos if n.op == "attention" and n.row_start == 0)
    assert qkv1.share == pytest.approx(0.539, abs=0.04)
    assert qkv1.share + attn0.share <= 1 + 1e-6


def test_stage2_with_no_interference_gain_does_not_beat_running_in_order():
    # P = R for memory too: sharing the device is never faster than taking turns, so the
    # best is the sum of every nano-operation's time (10 + 30 + 30 + 90 = 160 us).
    linear = {"memory": ((0.0, 0.0), (1.0, 1.0))}
    profiles = _profiles({"qkv": ("compute", 10.0), "attention": ("memory", 30.0)}, 4, linear)
    stage1 = solve_stage1(profiles, 512, {"qkv": 2, "attention": 2})
    assert solve_stage2(stage1, profiles).makespan_us == pytest.approx(160.0, rel=1e-6)


def test_stage2_with_no_interference_overlaps_for_free():
    # P = 1 at every share for memory (no interference, as a quiet CPU measured): no
    # constraint reads the memory ops' shares, and overlap still beats taking turns (160 us;
    # the compute op beside attention keeps 1 - MIN_SHARE of the device).
    flat = {"memory": ((0.0, 1.0), (1.0, 1.0))}
    profiles = _profiles({"qkv": ("compute", 10.0), "attention": ("memory", 30.0)}, 4, flat)
    stage1 = solve_stage1(profiles, 512, {"qkv": 2, "attention": 2})
    stage2 = solve_stage2(stage1, profiles)
    assert stage1.makespan_us <= stage2.makespan_us < 160.0
    assert all(0 < n.share <= 1 for n in stage2.nanos)


TINY = ModelShape("tiny-gqa", 2, 512, 8, 2, 64, 1024, 1000)


@pytest.mark.slow
@pytest.mark.parametrize("tp, dense_batch", [(1, 256), (2, 256)])
def test_every_emitted_schedule_passes_the_checker(tp, dense_batch):
    accel = get_accelerator("a100")
    mix = BatchMix(decode_fraction=0.75, decode_context=4096)
    profiles = synthetic_gpu_profiles(TINY, accel, 384, tp=tp, mix=mix)
    for interference in (False, True):
        schedule = search_schedule(profiles, dense_batch, 10.0, 1, interference)
        assert check(schedule) == []
        assert schedule.makespan_us <= schedule.sequential_us + 1e-6
        assert schedule.notes["counts"]["qkv"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("cyclic", [False, True])
def test_the_search_keeps_the_faster_partitioning(cyclic):
    # NanoFlow §4.1.2's operation transformations: the attention half's all-reduce, or an
    # all-gather either side of O, each searched; the faster one is kept.
    accel = get_accelerator("a100")
    mix = BatchMix(decode_fraction=0.75, decode_context=4096)
    schedules = [
        search_schedule(
            synthetic_gpu_profiles(TINY, accel, 256, tp=2, mix=mix, partitioning=part),
            256, 10.0, 1, cyclic=cyclic,
        )
        for part in PARTITIONINGS
    ]  # fmt: skip
    for schedule, part in zip(schedules, PARTITIONINGS, strict=True):
        assert check(schedule) == [] and schedule.notes["partitioning"] == part
    ops = {n.op for n in schedules[1].nano_ops}
    assert {"allgather_attn", "allgather_o"} <= ops and "allreduce_attn" not in ops
    assert schedules[1].device.endswith("-tp2-allgather")
    costs = [schedule_cost_us(s) for s in schedules]
    best = best_partitioning(schedules)
    assert schedule_cost_us(best) == min(costs)
    assert best.notes["partitioning_costs_us"] == dict(
        zip(PARTITIONINGS, [round(c, 3) for c in costs], strict=True)
    )


def test_schedules_are_cached_per_model_device_and_batch(tmp_path):
    profiles = synthetic_gpu_profiles(TINY, get_accelerator("a100"), 256)
    first, hit = cached_schedule(profiles, 256, tmp_path, 10.0)
    again, hit_again = cached_schedule(profiles, 256, tmp_path, 10.0)
    assert (hit, hit_again) == (False, True) and again == first
    assert [p.name for p in tmp_path.iterdir()] == ["schedule-tiny-gqa-a100-80gb-b256.json"]


# --- the reference's own inputs: synthetic A100 profiles and Table 3 --------------------


def _overlaps(a, b) -> bool:
    return (
        a.start_us < b.start_us + b.duration_us - 1e-6
        and b.start_us < a.start_us + a.duration_us - 1e-6
    )


def _two_way(model: str, tp: int):
    profiles = synthetic_gpu_profiles(get_model(model), get_accelerator("a100"), 2048, tp=tp)
    groups = set(split_groups(p.op for p in profiles.ops).values())
    stage1 = solve_stage1(profiles, 2048, {g: 2 for g in groups}, time_limit_s=30.0)
    sequential = sum(profiles.time_us(p.op, 2048) for p in profiles.ops)
    return profiles, stage1, sequential


@pytest.mark.slow
def test_8b_two_nano_operations_put_decode_attention_beside_up_gate_down():
    # NanoFlow §4.1.4: LLaMA-3-8B on one A100 runs every op in two nano-operations, decode
    # attention of one nano-batch overlapping the Up/Gate/Down GEMMs of the other.
    _, stage1, sequential = _two_way("llama-3-8b", 1)
    assert stage1.makespan_us < 0.85 * sequential
    attention = [n for n in stage1.nanos if n.op == "attention"]
    mlp = [n for n in stage1.nanos if n.op in ("gate_up", "down")]
    assert any(_overlaps(a, m) for a in attention for m in mlp)


@pytest.mark.slow
def test_70b_stage2_shares_are_in_the_reference_ballpark():
    # NanoFlow Figure 6: decode attention at R = 0.4 beside KQV, collectives at R 0.1-0.2.
    profiles, stage1, sequential = _two_way("llama-2-70b", 8)
    assert stage1.status == "optimal" and stage1.makespan_us < 0.85 * sequential
    stage2 = solve_stage2(stage1, profiles, time_limit_s=30.0)
    assert stage1.makespan_us < stage2.makespan_us < sequential
    computes = [n for n in stage2.nanos if n.resource == "compute"]
    for n in stage2.nanos:
        beside = [c for c in computes if _overlaps(n, c)]
        if n.op == "attention" and beside:
            assert 0.3 <= n.share <= 0.6
        if n.resource == "network" and beside:
            assert n.share <= 0.4


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_random_profiles_and_splits_never_break_a_dependency(seed):
    # Random affine op times (a weight read plus a per-row part) over the whole layer at
    # TP 2, random nano-operation counts: Stage I and Stage II output must pass `check`,
    # optimal or cut short by the time limit alike.
    rng = random.Random(seed)
    resources = {op.name: op.resource for op in layer_ops(TINY, get_accelerator("a100"), 128, 2)}
    per_granule = {op: (res, rng.uniform(1, 30)) for op, res in resources.items()}
    profiles = _profiles(per_granule, 3)
    fixed = {op: rng.uniform(0, 10) for op in resources}
    profiles = Profiles(
        "random", "hand", 128,
        tuple(OpProfile(p.op, p.resource, p.token_counts,
                        tuple(t + fixed[p.op] for t in p.times_us)) for p in profiles.ops),
        dict(TABLE3_KNOTS), "synthetic",
    )  # fmt: skip
    counts = {g: rng.randint(1, 3) for g in set(split_groups(resources).values())}
    stage1 = solve_stage1(profiles, 384, counts, time_limit_s=1.0)
    for result in (stage1, solve_stage2(stage1, profiles, time_limit_s=1.0)):
        schedule = Schedule(
            "random", "hand", 384,
            tuple(NanoOp(n.op, n.row_start, n.row_end, n.resource, STREAMS[n.resource],
                         n.start_us, n.duration_us, n.share) for n in result.nanos),
            sequential_us=0.0,
        )  # fmt: skip
        assert check(schedule) == []


# --- cyclic: the layer pipeline as the decoder runs it, one layer after another --------


def _schedule(result, period=None) -> Schedule:
    notes = {} if period is None else {"period_us": period}
    return Schedule(
        "hand", "hand", sum(n.row_end - n.row_start for n in result.nanos if n.op == "qkv"),
        tuple(NanoOp(n.op, n.row_start, n.row_end, n.resource, STREAMS[n.resource],
                     n.start_us, n.duration_us, n.share) for n in result.nanos),
        sequential_us=0.0, notes=notes,
    )  # fmt: skip


def test_cyclic_stage1_hides_the_next_layers_head_behind_this_layers_tail():
    # qkv (compute) then attention (memory), 10 us per 128 rows each, 512 rows in halves.
    # One layer alone lasts 60 us (qkv[:256], then qkv[256:] beside attention[:256], then
    # attention[256:]). Repeated, the next layer's qkv[:256] needs only attention[:256]
    # of this one, so it runs beside attention[256:]: a layer every 40 us, each
    # resource's whole load (the bound no schedule beats).
    profiles = _profiles({"qkv": ("compute", 10.0), "attention": ("memory", 10.0)}, 4)
    per_layer = solve_stage1(profiles, 512, {"qkv": 2, "attention": 2})
    cyclic = solve_stage1(profiles, 512, {"qkv": 2, "attention": 2}, cyclic=True)
    assert per_layer.period_us is None and per_layer.cost_us == pytest.approx(60.0)
    assert cyclic.status == "optimal" and cyclic.period_us == pytest.approx(40.0)
    assert check(_schedule(cyclic, cyclic.period_us)) == []
    # The same layer at a shorter period puts two layers' nano-operations on one stream
    # at once, and the checker sees it.
    assert any("across layers" in p for p in check(_schedule(cyclic, 35.0)))


def test_cyclic_stage1_respects_the_dependency_into_the_next_layer():
    # attention (memory) 30 us per 128 rows after a 10 us qkv: the memory load (120 us)
    # bounds the period; the checker catches a next layer that starts its qkv on rows
    # whose attention has not ended.
    profiles = _profiles({"qkv": ("compute", 10.0), "attention": ("memory", 30.0)}, 4)
    cyclic = solve_stage1(profiles, 512, {"qkv": 2, "attention": 2}, cyclic=True)
    assert cyclic.period_us == pytest.approx(120.0)
    assert check(_schedule(cyclic, cyclic.period_us)) == []
    early = cyclic.period_us - 1.0
    late_attention = max(n.start_us + n.duration_us for n in cyclic.nanos if n.op == "attention")
    first_qkv = min(n.start_us for n in cyclic.nanos if n.op == "qkv")
    assert late_attention > first_qkv + early  # the last attention overlaps the next layer
    assert any("next layer" in p for p in check(_schedule(cyclic, early)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_cyclic_random_profiles_pass_the_checker_and_never_lose_to_one_layer(seed):
    # Random affine op times over the whole TP-2 layer: the cyclic schedule is valid across
    # layers, and its period is never above the one-layer makespan (that schedule,
    # repeated, is a pipeline too) nor below any resource's load.
    rng = random.Random(100 + seed)
    resources = {op.name: op.resource for op in layer_ops(TINY, get_accelerator("a100"), 128, 2)}
    fixed = {op: rng.uniform(0, 10) for op in resources}
    per_row = {op: rng.uniform(1, 30) for op in resources}
    counts_rows = tuple(128 * m for m in range(1, 4))
    profiles = Profiles(
        "random", "hand", 128,
        tuple(OpProfile(op, res, counts_rows, tuple(fixed[op] + per_row[op] * m for m in (1, 2, 3)))
              for op, res in resources.items()),
        dict(TABLE3_KNOTS), "synthetic",
    )  # fmt: skip
    counts = {g: rng.randint(1, 3) for g in set(split_groups(resources).values())}
    per_layer = solve_stage1(profiles, 384, counts, time_limit_s=2.0)
    cyclic = solve_stage1(profiles, 384, counts, 2.0, per_layer.nanos, cyclic=True)
    assert check(_schedule(cyclic, cyclic.period_us)) == []
    assert cyclic.period_us <= per_layer.makespan_us * (1 + 1e-6) + 1e-4  # rounding bumps
    for res in set(resources.values()):
        load = sum(n.duration_us for n in cyclic.nanos if n.resource == res)
        assert cyclic.period_us >= load - 1e-6


def test_cyclic_stage2_shares_match_table3_by_hand():
    # The Stage II example above, repeated layer after layer: Stage I's pipeline keeps
    # both streams busy all the time (period 20 us). Under Table 3 each compute
    # nano-operation then shares the device with a memory one: a period of
    # max(20 / R, 20 / P(1 - R)), least at R = P(1 - R) = 0.539: 37.1 us, against 40 us
    # for taking turns.
    profiles = _profiles({"qkv": ("compute", 10.0), "attention": ("memory", 10.0)}, 2)
    stage1 = solve_stage1(profiles, 256, {"qkv": 2, "attention": 2}, cyclic=True)
    assert stage1.period_us == pytest.approx(20.0)
    stage2 = solve_stage2(stage1, profiles)
    assert 20 / 0.539 * 0.999 <= stage2.period_us <= 20 / 0.539 * 1.02
    assert check(_schedule(stage2, stage2.period_us)) == []
    for n in stage2.nanos:
        expected = 0.539 if n.resource == "compute" else 1 - 0.539
        assert n.share == pytest.approx(expected, abs=0.04)

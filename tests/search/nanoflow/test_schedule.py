"""The schedule record's JSON form and its checker (search/nanoflow/schedule.py)."""

from search.nanoflow.schedule import NanoOp, Schedule, check, depends_on


def _layer(nano_ops, dense_batch=256) -> Schedule:
    return Schedule("m", "d", dense_batch, tuple(nano_ops), sequential_us=40.0)


def _valid() -> Schedule:
    # qkv on two nano-batches (compute stream), attention of each after its own rows.
    return _layer(
        [
            NanoOp("qkv", 0, 128, "compute", 0, 0.0, 10.0),
            NanoOp("qkv", 128, 256, "compute", 0, 10.0, 10.0),
            NanoOp("attention", 0, 128, "memory", 1, 10.0, 10.0, share=0.5),
            NanoOp("attention", 128, 256, "memory", 1, 20.0, 10.0),
        ]
    )


def test_a_valid_pipeline_passes_and_survives_json(tmp_path):
    schedule = _valid()
    assert check(schedule) == []
    assert schedule.makespan_us == 30.0 and schedule.is_split
    schedule.save(tmp_path / "s.json")
    assert Schedule.load(tmp_path / "s.json") == schedule


def test_dependency_by_row_intersection():
    qkv0, qkv1, attn0, attn1 = _valid().nano_ops
    assert depends_on(attn0, qkv0) and not depends_on(attn0, qkv1)
    assert depends_on(attn1, qkv1) and not depends_on(qkv1, attn1)


def test_a_start_before_its_dependency_ends_is_reported():
    ops = list(_valid().nano_ops)
    ops[2] = NanoOp("attention", 0, 128, "memory", 1, 5.0, 10.0)  # qkv[0:128] ends at 10
    problems = check(_layer(ops))
    assert len(problems) == 1 and "attention[0:128] starts at 5.000 us" in problems[0]


def test_two_nano_ops_overlapping_on_one_stream_are_reported():
    ops = list(_valid().nano_ops)
    ops[1] = NanoOp("qkv", 128, 256, "compute", 0, 5.0, 10.0)
    assert any("stream 0" in p for p in check(_layer(ops)))


def test_rows_must_tile_the_dense_batch():
    ops = list(_valid().nano_ops)
    ops[3] = NanoOp("attention", 128, 192, "memory", 1, 20.0, 10.0)
    assert any("rows end at 192" in p for p in check(_layer(ops)))
    ops[3] = NanoOp("attention", 160, 256, "memory", 1, 20.0, 10.0)
    assert any("do not tile" in p for p in check(_layer(ops)))
    ops[3] = NanoOp("mystery", 128, 256, "memory", 1, 20.0, 10.0)
    assert any("unknown op" in p for p in check(_layer(ops)))


def test_a_layer_mixing_the_two_partitionings_is_reported():
    def layer(*names):
        return _layer(
            [NanoOp(n, 0, 256, "network", 2, 10.0 * i, 10.0) for i, n in enumerate(names)]
        )

    assert check(layer("allgather_attn", "allgather_o")) == []
    assert check(layer("allreduce_attn", "allreduce_mlp")) == []
    problems = check(layer("allgather_attn", "allreduce_attn"))
    assert problems == ["the attention half mixes the all-reduce and all-gather partitionings"]

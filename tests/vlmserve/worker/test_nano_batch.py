"""Nano-batched layers: equal to the unsplit decoder (hidden states, KV cache, greedy
tokens end to end, GQA and MHA, prefill chunks and decodes in one step), schedules that
break dependencies refused before they run, the plain path where splitting does not pay.

Tolerance: float32, |nano - plain| <= 1e-6 + 1e-5 |plain| (the only difference is the
attention backend grouping a nano-batch's decodes apart from the others')."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from kernels.attention import AttentionBatch
from kernels.backends import select_backend
from kernels.packed_linear import pack_linears
from search.nanoflow.handmade_schedules import (
    four_two_schedule,
    list_schedule,
    sequential_schedule,
    two_way_schedule,
)
from search.nanoflow.schedule import NanoOp, Schedule
from tests.helpers import make_engine, run_checked
from vlmserve.cli.engine_args import engine_config_from_args
from vlmserve.cli.main import build_parser
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.loader import load_model
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint
from vlmserve.worker.nano_batch import NanoBatcher, load_schedules, map_rows
from vlmserve.worker.nano_exec import NanoExecutor

TOL = {"atol": 1e-6, "rtol": 1e-5}


def duration(op: str, rows: int) -> float:
    """Attention-heavy, as at long contexts: every hand-made split pays."""
    return (6.0 if op == "attention" else 1.0) * rows + 1.0


def three_streams(batch: int) -> Schedule:
    """Attention of each half on its own stream, the second half's MLP on a third."""
    h = batch // 2
    head = ("input_norm", "qkv", "rope_kv_write")
    mlp = ("o_proj", "post_norm", "gate_up", "silu_mul", "down")
    layout = [
        [(op, 0, h) for op in head] + [(op, h, batch) for op in head]
        + [(op, 0, h) for op in mlp],
        [("attention", 0, h)],
        [("attention", h, batch)] + [(op, h, batch) for op in mlp],
    ]  # fmt: skip
    return list_schedule("t", "cpu", batch, layout, duration)


SCHEDULES = {
    "two-way": lambda: two_way_schedule("t", "cpu", 16, duration),
    "two-way-uneven": lambda: two_way_schedule("t", "cpu", 16, duration, split=3),
    "four-two": lambda: four_two_schedule("t", "cpu", 32, duration),
    "three-streams": lambda: three_streams(16),
}


@pytest.fixture(scope="module")
def mha_path(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("mha"), "qwen2", kv_heads=4)


def mixed_step(cfg, backend, block_size: int = 4):
    """A step of decodes, a verification (2 rows), a chunk on a cached prefix and a
    fresh prefill, with random caches: (batch, slot_mapping, positions)."""
    query_lens, context_lens = [1, 20, 18, 1, 1, 2, 1], [9, 30, 18, 5, 13, 7, 40]
    tables, used, slots = [], 0, []
    for q_len, ctx in zip(query_lens, context_lens, strict=True):
        tables.append(list(range(used, used + -(-ctx // block_size))))
        used += len(tables[-1])
        slots += [tables[-1][p // block_size] * block_size + p % block_size
                  for p in range(ctx - q_len, ctx)]  # fmt: skip
    positions = torch.cat(
        [torch.arange(c - q, c) for q, c in zip(query_lens, context_lens, strict=True)]
    )
    batch = AttentionBatch(query_lens, context_lens, tables, block_size)
    return batch, torch.tensor(slots), positions, used


CASES = [(name, "cpu", "gqa") for name in SCHEDULES] + [
    ("four-two", "cpu", "mha"), ("three-streams", "cpu", "mha"),
    ("two-way", "torch", "gqa"), ("two-way-uneven", "torch", "mha"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "backend_name", "heads"), CASES)
def test_hidden_states_and_kv_equal_the_unsplit_decoder(
    name, backend_name, heads, llama_path, mha_path
):
    torch.manual_seed(0)
    backend = select_backend(torch.device("cpu"), backend_name)
    path = llama_path if heads == "gqa" else mha_path
    decoder = load_model(str(path), torch.float32, torch.device("cpu"), backend).decoder
    pack_linears(decoder)
    decoder.fused = True
    cfg = decoder.cfg
    batch, slots, positions, num_blocks = mixed_step(cfg, backend)
    shape = backend.kv_cache_shape(num_blocks, batch.block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.randn(shape) for _ in range(cfg.num_layers)]
    x = torch.randn(slots.numel(), cfg.hidden_size)
    batcher = NanoBatcher([SCHEDULES[name]()], backend)
    step = batcher.plan(batch, slots)
    assert step is not None and len({t.start for t in step.tasks}) > 1
    executor = NanoExecutor(batcher.num_streams, torch.device("cpu"), 1)
    with torch.inference_mode():
        plain_caches = [c.clone() for c in caches]
        meta = backend.build_metadata(batch, slots, torch.device("cpu"))
        plain = decoder(x.clone(), positions, meta, plain_caches)
        nano = decoder(x.clone(), positions, meta, caches,
                       functools.partial(executor.run_layers, step=step))  # fmt: skip
    executor.close()
    torch.testing.assert_close(nano, plain, **TOL)
    for a, b in zip(caches, plain_caches, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_a_failing_nano_operation_raises_and_releases_the_other_stream(llama_path):
    backend = select_backend(torch.device("cpu"), "cpu")
    decoder = load_model(str(llama_path), torch.float32, torch.device("cpu"), backend).decoder
    batch, slots, positions, _ = mixed_step(decoder.cfg, backend)
    batcher = NanoBatcher([SCHEDULES["two-way"]()], backend)
    step = batcher.plan(batch, slots)
    executor = NanoExecutor(2, torch.device("cpu"), 1)
    meta = backend.build_metadata(batch, slots, torch.device("cpu"))
    x = torch.randn(slots.numel(), decoder.cfg.hidden_size)
    with torch.inference_mode(), pytest.raises(IndexError):  # no KV cache: attention fails
        decoder(x, positions, meta, [], functools.partial(executor.run_layers, step=step))
    executor.close()


def test_rows_snap_to_sequence_starts_and_empty_nano_ops_drop():
    schedule = four_two_schedule("t", "cpu", 32, duration)  # cuts 0, 12, 24, 28, 32
    # 40 rows: cuts scale to 15, 30, 35 -> the nearest sequence starts 14, 30, 34.
    ops = map_rows(schedule, [0, 1, 14, 30, 31, 34, 40])
    assert sorted({(n.row_start, n.row_end) for n in ops if n.op == "attention"}) == [
        (0, 14), (14, 30), (30, 34), (34, 40)
    ]  # fmt: skip
    # One long chunk and one decode: the 3/8 cut snaps to 0, 3/4 and 7/8 to the end.
    ops = map_rows(schedule, [0, 30, 31])
    assert sorted({(n.row_start, n.row_end) for n in ops if n.op == "attention"}) == [
        (0, 30), (30, 31)
    ]  # fmt: skip
    assert map_rows(schedule, [0, 31]) is None  # one sequence: nothing to split


def test_the_plain_path_runs_where_the_split_does_not_pay_or_cannot_be_made():
    backend = select_backend(torch.device("cpu"), "torch")
    pays = two_way_schedule("t", "cpu", 8, duration)
    flat = two_way_schedule("t", "cpu", 16, lambda op, rows: 5.0)  # no overlap to gain
    assert flat.makespan_us >= flat.sequential_us and pays.makespan_us < pays.sequential_us
    batcher = NanoBatcher([pays, flat], backend)

    def plan(query_lens):
        batch = AttentionBatch(query_lens, query_lens, [[0]] * len(query_lens), 64)
        return batcher.plan(batch, torch.arange(sum(query_lens)))

    assert plan([1] * 8) is not None
    assert plan([1] * 7) is None  # below the smallest schedule's dense batch
    assert plan([1] * 16) is None  # the 16-row schedule does not pay
    assert plan([12]) is None  # one prefill chunk
    assert NanoBatcher([flat], backend, always=True).plan(
        AttentionBatch([1] * 16, [1] * 16, [[0]] * 16, 64), torch.arange(16)
    ) is not None  # fmt: skip
    unsplit = sequential_schedule("t", "cpu", 8, duration)
    assert NanoBatcher([unsplit], backend, always=True).plan(
        AttentionBatch([1] * 8, [1] * 8, [[0]] * 8, 64), torch.arange(8)
    ) is None  # fmt: skip


def broken_schedules() -> dict[str, Schedule]:
    good = two_way_schedule("t", "cpu", 16, duration)
    early = tuple(
        dataclasses.replace(n, start_us=0.0) if (n.op, n.row_start) == ("attention", 8) else n
        for n in good.nano_ops
    )
    overlap = (*good.nano_ops, NanoOp("down", 4, 12, "compute", 0, 1e6, 1.0))
    return {
        "attention before its rope": dataclasses.replace(good, nano_ops=early),
        "rows overlap": dataclasses.replace(good, nano_ops=overlap),
        "no silu_mul": dataclasses.replace(
            good, nano_ops=tuple(n for n in good.nano_ops if n.op != "silu_mul")
        ),
    }


@pytest.mark.parametrize("broken", broken_schedules())
def test_a_schedule_that_breaks_dependencies_is_refused_before_it_runs(
    broken, llama_path, tmp_path
):
    schedule = broken_schedules()[broken]
    backend = select_backend(torch.device("cpu"), "torch")
    with pytest.raises(ValueError, match="refused"):
        NanoBatcher([schedule], backend)
    schedule.save(tmp_path / "s.json")
    with pytest.raises(ValueError, match="refused"):
        load_schedules(tmp_path)
    with pytest.raises(ValueError, match="refused"):  # the engine refuses it at start
        make_engine(llama_path, nano_batch=str(tmp_path / "s.json"))


@pytest.fixture(scope="module")
def schedule_dir(tmp_path_factory):
    """Two-way at 8 rows, four-two at 16: steps of 8-15 rows split two ways, more four."""
    folder = tmp_path_factory.mktemp("schedules")
    two_way_schedule("t", "cpu", 8, duration).save(folder / "b8.json")
    four_two_schedule("t", "cpu", 16, duration).save(folder / "b16.json")
    return folder


def spy_plans(engine) -> list[tuple[list[int], bool]]:
    """(query lengths, split?) of every step the batcher planned."""
    seen, plan = [], engine.runner.nano_batcher.plan

    def recorded(batch, slots):
        step = plan(batch, slots)
        seen.append((list(batch.query_lens), step is not None))
        return step

    engine.runner.nano_batcher.plan = recorded
    return seen


def text_requests() -> list[Request]:
    gen = torch.Generator().manual_seed(3)
    return [
        Request(
            prompt_token_ids=torch.randint(3, 250, (4 + 5 * i,), generator=gen).tolist(),
            sampling=SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True),
            request_id=f"t{i}",
        )
        for i in range(6)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("heads", ["gqa", "mha"])
def test_engine_greedy_tokens_equal_the_unsplit_engine(heads, llama_path, mha_path, schedule_dir):
    path = llama_path if heads == "gqa" else mha_path
    plain = run_checked(make_engine(path, budget=24), text_requests())
    engine = make_engine(path, budget=24, nano_batch=str(schedule_dir))
    plans = spy_plans(engine)
    nano = run_checked(engine, text_requests())
    assert [o.token_ids for o in nano] == [o.token_ids for o in plain]
    split = [lens for lens, was_split in plans if was_split]
    assert engine.runner.num_nano_steps == len(split) > 0
    # Prefill chunks and decodes were split in one step.
    assert any(max(lens) > 1 and min(lens) == 1 for lens in split)


@pytest.mark.slow
def test_auto_runs_the_searched_schedules_and_keeps_the_tokens(llama_path, tmp_path, monkeypatch):
    from search.nanoflow import profiles
    from vlmserve.worker.nano_schedules import engine_schedules

    monkeypatch.setattr(profiles, "DEFAULT_CACHE_DIR", tmp_path)
    # Searched here with a short time limit; the engine's start reads them from the cache.
    searched = engine_schedules(str(llama_path), "cpu", 64, time_limit_s=1)
    plain = run_checked(make_engine(llama_path, budget=64), text_requests())
    engine = make_engine(llama_path, budget=64, nano_batch="auto")
    assert engine.runner.nano_batcher.schedules == searched.schedules
    nano = run_checked(engine, text_requests())
    assert [o.token_ids for o in nano] == [o.token_ids for o in plain]
    # Steps split exactly where the search said overlap pays.
    assert (engine.runner.num_nano_steps > 0) == bool(searched.paying_batches)


def test_nano_batch_flag_reaches_the_engine_from_each_door(schedule_dir):
    doors = [["generate", "--prompt", "x"], ["demo"], ["serve"],
             ["caption", "in", "--output", "o.jsonl"]]  # fmt: skip
    for door in doors:
        args = build_parser().parse_args([*door, "--nano-batch", str(schedule_dir)])
        assert engine_config_from_args(args).model.nano_batch == str(schedule_dir)
        assert engine_config_from_args(build_parser().parse_args(door)).model.nano_batch == "off"
        auto = build_parser().parse_args([*door, "--nano-batch", "auto"])
        assert engine_config_from_args(auto).model.nano_batch == "auto"
    with pytest.raises(ValueError, match="nano_batch"):
        engine_config_from_args(build_parser().parse_args(["demo", "--nano-batch", "nope"]))


@pytest.mark.gpu
def test_cuda_streams_equal_the_unsplit_decoder(llama_path):
    device = torch.device("cuda")
    backend = select_backend(device, block_size=16)  # Triton's blocks are 16+
    decoder = load_model(str(llama_path), torch.float32, device, backend).decoder
    cfg = decoder.cfg
    batch, slots, positions, num_blocks = mixed_step(cfg, backend, block_size=16)
    shape = backend.kv_cache_shape(num_blocks, batch.block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.randn(shape, device=device) for _ in range(cfg.num_layers)]
    x = torch.randn(slots.numel(), cfg.hidden_size, device=device)
    from vlmserve.worker.runner import _to_device

    # metadata is built on the host; the runner moves it (the plain path's too)
    meta = _to_device(backend.build_metadata(batch, slots, device), device)
    for name in SCHEDULES:
        batcher = NanoBatcher([SCHEDULES[name]()], backend)
        step = _to_device(batcher.plan(batch, slots), device)
        executor = NanoExecutor(batcher.num_streams, device, 1)
        with torch.inference_mode():
            plain_caches = [c.clone() for c in caches]
            plain = decoder(x.clone(), positions.to(device), meta, plain_caches)
            nano = decoder(x.clone(), positions.to(device), meta, [c.clone() for c in caches],
                           functools.partial(executor.run_layers, step=step))  # fmt: skip
        torch.testing.assert_close(nano, plain, **TOL)

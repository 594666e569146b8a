"""`--nano-batch auto`'s schedules: searched for the engine's own model and device, valid,
cached by decoder shape and read back on the next start."""

from __future__ import annotations

import pytest

from search.nanoflow.profiles import try_load_profiles
from search.nanoflow.schedule import check
from vlmserve.worker.models.random_checkpoint import make_text_checkpoint
from vlmserve.worker.nano_schedules import (
    cpu_device_key,
    dense_batches,
    engine_schedules,
)


def test_a_gpu_without_a_preset_is_refused_with_what_to_do(tmp_path):
    path = make_text_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="GTX 1080.*estimate pipeline"):
        engine_schedules(str(path), "cuda", 512, "NVIDIA GeForce GTX 1080", tmp_path / "cache")


def test_dense_batches_are_those_a_step_can_reach():
    assert dense_batches("cpu", 2048) == [64, 128, 256]
    assert dense_batches("cpu", 100) == [64]
    assert dense_batches("cpu", 32) == []
    assert dense_batches("cuda", 1024) == [256, 512, 1024]


@pytest.mark.slow
def test_cpu_schedules_are_searched_once_then_read_back_by_shape(tmp_path):
    first_dir = make_text_checkpoint(tmp_path / "a", layers=1)
    found = engine_schedules(str(first_dir), "cpu", 64, cache_dir=tmp_path / "c", time_limit_s=1)
    assert not found.cached
    [schedule] = found.schedules
    assert schedule.dense_batch == 64 and check(schedule) == []
    assert (schedule.is_split and schedule.makespan_us < schedule.sequential_us) == (
        found.paying_batches == [64]
    )
    # The measured profiles are this CPU's, under the shape's name.
    profiles = try_load_profiles(tmp_path / "c", schedule.model, cpu_device_key())
    assert profiles is not None and profiles.source == "measured"
    # Another checkpoint of the same shape reads the same schedule back; another shape not.
    same_shape = make_text_checkpoint(tmp_path / "b", layers=1, seed=1)
    again = engine_schedules(str(same_shape), "cpu", 64, cache_dir=tmp_path / "c")
    assert again.cached and again.schedules == found.schedules
    other = make_text_checkpoint(tmp_path / "d", layers=1, hidden=32)
    found_other = engine_schedules(str(other), "cpu", 64, cache_dir=tmp_path / "c", time_limit_s=1)
    assert not found_other.cached and found_other.schedules[0].model != schedule.model


def test_gpu_schedules_come_from_the_presets_synthetic_profiles(tmp_path):
    path = make_text_checkpoint(tmp_path / "m", layers=1)
    found = engine_schedules(
        str(path), "cuda", 300, "NVIDIA H100 80GB HBM3", tmp_path / "c", time_limit_s=1
    )
    [schedule] = found.schedules
    assert schedule.dense_batch == 256 and schedule.device == "h100-sxm"
    assert schedule.notes["profiles"] == "synthetic" and check(schedule) == []

"""The CPU kernel choices' calibration: each pure rule picks the faster path given its
measurements (both ways), the cache is keyed by the machine and recalibrates when the key
changes, and the layers take the choice the cache holds, with numerics equal to F.linear."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from kernels import calibration, cpu_attention, packed_linear
from kernels.backends import choose_attention_paths, select_backend
from tests.kernels.choices.calibration_cache import (
    BF16,
    count_paths,
    needs_onednn,
    needs_packable,
    store,
)


def ladder(*rows_fast_slow, fast="skinny", slow="onednn"):
    return [{"rows": r, fast: a, slow: b} for r, a, b in rows_fast_slow]


# -- the pure rules -----------------------------------------------------------------------


def test_mkl_is_taken_only_where_it_won_from_the_largest_size_down():
    def mkl(*rows_onednn_mkl):
        return calibration.decide_mkl(ladder(*rows_onednn_mkl, fast="onednn", slow="mkl"))

    assert mkl((2048, 1.0, 2.0)) is None  # MKL lost at 2,048 (Zen 5)
    assert mkl((2048, 1.0, 0.98)) is None  # within the margin: noise
    assert mkl((2048, 1.0, 0.8), (1024, 1.0, 0.8)) == 1024
    assert mkl((2048, 1.0, 0.8), (1024, 0.5, 0.6)) == 1536  # (Zen 3)
    assert mkl((2048, 1.0, 2.0), (1024, 1.0, 0.5)) is None


def test_the_skinny_kernel_takes_the_rows_it_was_faster_at():
    # skinny ahead up to 8 rows, behind from 16 (a Zen 5 in bfloat16)
    zen = ladder((1, 1.0, 1.1), (2, 1.0, 1.2), (4, 1.0, 1.1), (8, 1.0, 1.05), (16, 2.0, 1.0))
    assert calibration.decide_max_rows(zen, "skinny", "onednn") == 8
    # the other way round: oneDNN ahead from 2 rows (matrix units)
    amx = ladder((1, 1.0, 1.2), (2, 2.0, 1.0), (4, 3.0, 1.0), (8, 5.0, 1.0))
    assert calibration.decide_max_rows(amx, "skinny", "onednn") == 1
    behind = ladder((1, 1.3, 1.0), (2, 1.5, 1.0))
    assert calibration.decide_max_rows(behind, "skinny", "onednn") == 0
    ahead = ladder((1, 0.5, 1.0), (64, 0.9, 1.0))
    assert calibration.decide_max_rows(ahead, "skinny", "onednn") == 64
    # one noisy sample (2 rows, skinny slightly behind) between wins does not cut it short
    blip = ladder((1, 1.0, 2.0), (2, 1.05, 1.0), (4, 1.0, 2.0), (8, 3.0, 1.0))
    assert calibration.decide_max_rows(blip, "skinny", "onednn") == 4


def test_the_prefill_kernel_is_kept_where_it_was_faster():
    zen = [{"kernel": 1.0, "sdpa": 5.0}, {"kernel": 2.0, "sdpa": 9.0}]
    amx = [{"kernel": 79.0, "sdpa": 28.5}, {"kernel": 40.0, "sdpa": 20.0}]
    assert calibration.decide_faster(zen, "kernel", "sdpa")
    assert not calibration.decide_faster(amx, "kernel", "sdpa")


# -- timing and the cache -----------------------------------------------------------------


def test_time_paths_times_each_path_on_its_own():
    # sleeps: a loaded machine only lengthens them, so the ranking holds under any load
    calls = {"short": 0, "long": 0}

    def path(name: str, seconds: float):
        def run() -> None:
            calls[name] += 1
            time.sleep(seconds)

        return run

    seconds = calibration.time_paths({"short": path("short", 2e-3), "long": path("long", 12e-3)})
    assert 2e-3 <= seconds["short"] and 12e-3 <= seconds["long"]
    assert seconds["long"] > 2 * seconds["short"]
    assert calls["long"] >= calibration.ROUNDS + 1 and calls["short"] >= calibration.ROUNDS + 1


def test_the_key_names_the_cpu_its_flags_torch_threads_and_kernels():
    key = calibration.machine_key()
    assert key["kernels"] == calibration.cpu_build.sources_digest()
    flags = calibration.cpu_build.cpu_flags()
    assert key["torch"] == torch.__version__ and key["threads"] == str(torch.get_num_threads())
    assert set(key["flags"].split()) == set(flags)
    assert key["cpu"] and key["cpu"] != "unknown" or not flags


def decide_probe(measured: list[dict]) -> int:
    """The rule the cache tests' "probe" choice is stored under."""
    return calibration.decide_max_rows(measured, "skinny", "onednn")


def test_a_choice_is_measured_once_per_machine_key(cache_dir, monkeypatch):
    calls = []

    def measure():
        calls.append(1)
        return [{"rows": 1, "skinny": 1.0, "onednn": 2.0}]

    assert calibration.calibrated("probe", measure, decide_probe) == 1 and len(calls) == 1
    stored = json.loads(calibration.cache_path().read_text())
    assert stored["key"] == calibration.machine_key()
    assert stored["choices"]["probe"]["choice"] == 1
    monkeypatch.setattr(calibration, "_entries", {})  # a new process: read from the file
    assert calibration.calibrated("probe", measure, decide_probe) == 1 and len(calls) == 1
    # another CPU model, other flags, another torch: another file, measured again
    real = calibration.cpu_build.cpu_features()
    for changed in (
        real.replace("model name", "model name\t: Another CPU\nignored"),
        real + " amx_bf16 amx_tile",
    ):
        monkeypatch.setattr(calibration.cpu_build, "cpu_features", lambda c=changed: c)
        before = len(calls)
        calibration.calibrated("probe", measure, decide_probe)
        assert len(calls) == before + 1
    monkeypatch.setattr(calibration.cpu_build, "cpu_features", lambda: real)
    monkeypatch.setattr(calibration.torch, "__version__", "0.0.1-other")
    before = len(calls)
    calibration.calibrated("probe", measure, decide_probe)
    assert len(calls) == before + 1
    monkeypatch.setattr(calibration.cpu_build, "sources_digest", lambda: "another-kernel")
    before = len(calls)
    calibration.calibrated("probe", measure, decide_probe)  # the kernels changed: measured again
    assert len(calls) == before + 1
    assert len(list(cache_dir.glob("*.json"))) == 5


def test_an_unreadable_stored_choice_is_measured_again(cache_dir):
    store("probe", [{"rows": 1, "fast": 1.0}])  # another protocol's records
    measured = [{"rows": 2, "skinny": 1.0, "onednn": 2.0}]

    assert calibration.calibrated("probe", lambda: measured, decide_probe) == 2


def test_recalibration_is_forced_by_the_env_var_and_by_forget(cache_dir, monkeypatch):
    calls = []

    def measure():
        calls.append(1)
        return [{"rows": 4, "skinny": 1.0, "onednn": 2.0}]

    calibration.calibrated("probe", measure, decide_probe)
    monkeypatch.setattr(calibration, "_entries", {})
    monkeypatch.setenv("VLMSERVE_RECALIBRATE", "1")  # the documented name
    calibration.calibrated("probe", measure, decide_probe)
    calibration.calibrated("probe", measure, decide_probe)  # once per process
    assert len(calls) == 2
    monkeypatch.delenv("VLMSERVE_RECALIBRATE")
    calibration.forget()
    assert not calibration.cache_path().exists()
    calibration.calibrated("probe", measure, decide_probe)
    assert len(calls) == 3
    assert "probe" in calibration.report()["choices"]


# -- the layers take the cached choice ----------------------------------------------------


@needs_onednn
@pytest.mark.usefixtures("needs_skinny")
def test_a_packed_linear_takes_the_skinny_rows_cached_for_its_shape(cache_dir, monkeypatch):
    needs_packable(BF16)
    store("linear_skinny_max_rows/bfloat16/64x48", ladder((2, 1.0, 2.0), (4, 3.0, 1.0)))
    layer = packed_linear.PackedLinear(nn.Linear(64, 48).to(BF16), plain=True)
    assert layer.skinny_rows == 2 and layer.plain_rows is None
    counts = count_paths(monkeypatch)
    layer(torch.randn(2, 64).to(BF16))
    assert counts["skinny"] == 1
    layer(torch.randn(3, 64).to(BF16))  # oneDNN's packed GEMM
    assert counts["skinny"] == 1


@needs_onednn
@pytest.mark.usefixtures("needs_skinny")
def test_the_linear_calibration_measures_both_paths_at_the_ladder(cache_dir):
    rows, mkl = packed_linear.plain_rows(torch.float32, (32, 40))
    entry = calibration.report()["choices"]["linear_skinny_max_rows/float32/32x40"]
    measured = entry["measured"]
    assert [r["rows"] for r in measured] == list(packed_linear.LINEAR_LADDER[: len(measured)])
    assert all(r["skinny"] > 0 and r["onednn"] > 0 for r in measured)
    assert rows == calibration.decide_max_rows(measured, "skinny", "onednn") == entry["choice"]
    assert mkl == calibration.decide_mkl(calibration.report()["choices"][
        "mkl_min_rows/float32/1024x1024"]["measured"])  # fmt: skip


def test_the_backend_takes_the_prefill_path_that_won(monkeypatch):
    if cpu_attention.available() or cpu_attention.prefill_available():
        pytest.skip("the CPU attention kernels did not build here")
    cpu = torch.device("cpu")
    for wins, name in ((True, "cpu"), (False, "cpu-sdpa")):
        monkeypatch.setattr(cpu_attention, "prefill_kernel_wins", lambda *a, w=wins: w)
        backend = select_backend(cpu, None, torch.float32)
        choose_attention_paths(backend, None, torch.float32, 4, 1, 256)
        assert backend.name == name and backend.prefill_kernel == wins
    backend = select_backend(cpu, "cpu", torch.float32)  # asked for by name: kept
    choose_attention_paths(backend, "cpu", torch.float32, 4, 1, 256)
    assert backend.name == "cpu"


def test_the_backend_decodes_on_the_path_that_won(monkeypatch):
    """decode_amx_wins and decode_spread_wins decide, asked-for backends included; the AMX
    path is False without AMX or in float32 whatever was measured."""
    if cpu_attention.available() or cpu_attention.prefill_available():
        pytest.skip("the CPU attention kernels did not build here")
    cpu = torch.device("cpu")
    assert not cpu_attention.decode_amx_wins(torch.float32, 4, 1, 256)
    assert not cpu_attention.decode_amx_wins(torch.bfloat16, 4, 1, 72)  # not a multiple of 32
    for wins in (True, False):
        monkeypatch.setattr(cpu_attention, "decode_amx_wins", lambda *a, w=wins: w)
        monkeypatch.setattr(cpu_attention, "decode_spread_wins", lambda *a, w=wins: not w)
        for preferred in (None, "cpu"):
            backend = select_backend(cpu, preferred, torch.bfloat16)
            choose_attention_paths(backend, preferred, torch.bfloat16, 4, 1, 256)
            assert backend.decode_amx == wins and backend.decode_spread == (not wins)


@pytest.mark.slow
def test_the_prefill_calibration_times_both_paths(cache_dir, monkeypatch):
    if cpu_attention.available() or cpu_attention.prefill_available():
        pytest.skip("the CPU attention kernels did not build here")
    cases = ((0, 64), (32, 32))
    monkeypatch.setattr(cpu_attention, "PREFILL_CASES", cases)
    wins = cpu_attention.prefill_kernel_wins(torch.float32, 4, 1, 32)
    measured = calibration.report()["choices"]["prefill_attention/float32/4x1x32"]["measured"]
    assert [(r["cached"], r["tokens"]) for r in measured] == list(cases)
    assert wins == calibration.decide_faster(measured, "kernel", "sdpa")


@pytest.mark.slow
def test_the_prefetch_calibration_times_both_ways_from_memory(cache_dir, monkeypatch):
    """decode_spread_wins times the vector path's two prefetches over caches of the bytes
    asked for (past the L3 at its default), and its choice is the faster one's."""
    if cpu_attention.available():
        pytest.skip("the CPU attention kernels did not build here")
    assert cpu_attention.decode_spread_wins(torch.float16, 4, 1, 256)  # prefetched whole
    monkeypatch.setattr(cpu_attention, "SPREAD_CASE", (4, 64, 8 << 20))
    wins = cpu_attention.decode_spread_wins(torch.bfloat16, 4, 1, 256)
    measured = calibration.report()["choices"]["decode_prefetch/bfloat16/4x1x256"]["measured"]
    assert [(r["sequences"], r["context"]) for r in measured] == [(4, 64)]
    assert measured[0]["spread"] > 0 and measured[0]["whole"] > 0
    assert wins == calibration.decide_faster(measured, "spread", "whole")

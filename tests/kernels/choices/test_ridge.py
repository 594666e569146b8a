"""Adaptive speculation's ridge B* on a CPU (vlmserve/sample/verify.py): calibrated in the
engine's dtype and cached with the kernel choices, B* = s_w·π/(2β) (article §11)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import calibration
from scheduler.config import DEFAULT_DRAFTS, SchedulerConfig, SpeculativeConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.sample import verify

N = verify.RIDGE_GEMM


def fake_machine(monkeypatch, gemm_s: float, copy: float) -> list[torch.dtype]:
    """A GEMM that takes `gemm_s` and a copy of `copy` bytes/s; the dtypes the GEMM ran in."""
    ran: list[torch.dtype] = []

    def time_paths(paths, rounds=calibration.ROUNDS):
        ran.append(paths["gemm"]().dtype)
        return {"gemm": gemm_s}

    monkeypatch.setattr(calibration, "time_paths", time_paths)
    monkeypatch.setattr(verify, "copy_bandwidth", lambda: copy)
    return ran


@pytest.mark.parametrize(("dtype", "bytes_per_weight"), [(torch.bfloat16, 2), (torch.float32, 4)])
def test_the_cpu_ridge_is_measured_in_the_engines_dtype(
    cache_dir, monkeypatch, dtype, bytes_per_weight
):
    ran = fake_machine(monkeypatch, gemm_s=0.01, copy=20e9)
    ridge = verify.ridge_batch_for(torch.device("cpu"), dtype)
    assert ran == [dtype]  # π of the format the GEMMs run in, not float32's for bfloat16
    flops = 2 * N**3 / 0.01
    assert ridge == pytest.approx(bytes_per_weight * flops / (2 * 20e9))  # §11's B*


def test_the_cpu_ridge_is_cached_per_dtype_and_read_back(cache_dir, monkeypatch):
    ran = fake_machine(monkeypatch, gemm_s=0.004, copy=25e9)
    first = verify.ridge_batch_for(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(calibration, "_entries", {})  # a new process on this machine
    assert verify.ridge_batch_for(torch.device("cpu"), torch.bfloat16) == first
    assert len(ran) == 1  # measured once
    choices = json.loads(calibration.cache_path().read_text())["choices"]
    (record,) = choices["ridge/bfloat16"]["measured"]
    assert record == {"gemm_flops": pytest.approx(2 * N**3 / 0.004), "copy_bytes_per_s": 25e9}
    verify.ridge_batch_for(torch.device("cpu"), torch.float32)
    assert ran == [torch.bfloat16, torch.float32]  # another dtype: its own measurement


def test_the_ridge_measurement_runs_on_this_cpu(cache_dir):
    (record,) = verify.measure_cpu_ridge(torch.bfloat16)
    assert record["gemm_flops"] > 1e8 and record["copy_bytes_per_s"] > 1e8


def test_speculation_takes_the_ridge_or_turns_off_where_there_is_none(
    cache_dir, monkeypatch, caplog
):
    fake_machine(monkeypatch, gemm_s=0.01, copy=20e9)
    cpu = torch.device("cpu")

    def resolved(speculative=None, async_scheduling=False):
        engine = EngineConfig(
            ModelConfig(str(DEFAULT_MODEL_DIR)),
            scheduler=SchedulerConfig(async_scheduling=async_scheduling),
            speculative=speculative or SpeculativeConfig(),
        )
        return verify.resolve_speculation(engine, cpu, torch.bfloat16)

    default = resolved()  # on by default, adaptive, gated by B*
    assert default.num_speculative_tokens == DEFAULT_DRAFTS and default.adaptive
    assert default.ridge_batch == verify.ridge_batch_for(cpu, torch.bfloat16)
    assert not resolved(async_scheduling=True).enabled  # asked for: drafts would stall it
    explicit = SpeculativeConfig(num_speculative_tokens=3, adaptive=False)
    assert resolved(explicit, async_scheduling=True) is explicit  # the engine runs it sync

    def no_preset(device, dtype):  # a GPU that no accelerator preset matches
        raise ValueError("no accelerator preset matches the GPU 'Some GPU'")

    monkeypatch.setattr(verify, "ridge_batch_for", no_preset)
    with caplog.at_level("WARNING"):
        off = resolved()
    assert not off.enabled and "no accelerator preset" in caplog.text


def test_the_quantized_ridge_is_one_rows_time_over_each_further_rows():
    """Flat while the weight read bounds the step, then 3 ms a row: B* = 10 / 3 rows."""
    measured = [{"rows": r, "step": max(10.0, 3.0 * r) * 1e-3} for r in verify.QUANT_RIDGE_ROWS]
    assert verify.decide_quantized_ridge(measured) == pytest.approx(10 / 3)
    flat = [{"rows": r, "step": 0.01} for r in verify.QUANT_RIDGE_ROWS]
    assert verify.decide_quantized_ridge(flat) == float("inf")  # never bound by arithmetic


def test_a_quantized_decoder_takes_the_lower_of_its_ridge_and_the_dtypes(cache_dir, monkeypatch):
    from kernels.quant_linear import QuantLinear, kernel_available, random_weight

    if (why := kernel_available()) is not None:
        pytest.skip(f"quantized kernels unavailable: {why}")
    decoder = torch.nn.Sequential(QuantLinear([random_weight(8, 64, 256)]))  # Q8_0
    timed: list[str] = []

    def time_paths(paths, rounds=calibration.ROUNDS):
        if "gemm" in paths:  # the dtype's ridge: B* = 50 rows
            return {"gemm": 2 * N**3 / (50 * 2 * 20e9 / 2)}
        timed.extend(["step"] if "step" in paths else [])  # (the layer's path choices too)
        return {name: 0.01 for name in paths}

    monkeypatch.setattr(calibration, "time_paths", time_paths)
    monkeypatch.setattr(verify, "copy_bandwidth", lambda: 20e9)
    monkeypatch.setattr(verify, "decide_quantized_ridge", lambda measured: 3.5)
    engine = EngineConfig(ModelConfig(str(DEFAULT_MODEL_DIR)))
    cpu = torch.device("cpu")
    assert verify.resolve_speculation(engine, cpu, torch.bfloat16).ridge_batch == pytest.approx(50)
    resolved = verify.resolve_speculation(engine, cpu, torch.bfloat16, decoder)
    assert resolved.ridge_batch == 3.5 and len(timed) == len(verify.QUANT_RIDGE_ROWS)
    dense = torch.nn.Sequential(torch.nn.Linear(256, 64))
    assert verify.resolve_speculation(engine, cpu, torch.bfloat16, dense).ridge_batch == 50

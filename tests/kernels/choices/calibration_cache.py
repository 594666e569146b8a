"""The kernel-choice tests' shared parts: a fresh calibration cache (`cache_dir`), choices
stored as an earlier calibration would have (`store`), the skinny kernel's and oneDNN's
calls counted (`count_paths`)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import calibration, packed_linear

BF16 = torch.bfloat16
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh calibration cache, as in a new process on a new machine."""
    monkeypatch.setattr(calibration, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(calibration, "_entries", {})
    monkeypatch.delenv(calibration.RECALIBRATE_ENV, raising=False)
    return tmp_path


def needs_packable(dtype: torch.dtype) -> None:
    """Skip where oneDNN takes no `dtype` here (bfloat16 on an AVX2-only CPU)."""
    if not packed_linear.packable(dtype):
        pytest.skip(f"oneDNN takes no {dtype} on this CPU")


@pytest.fixture
def needs_skinny():
    if (why := packed_linear.skinny_available()) is not None:
        pytest.skip(f"skinny kernel unavailable: {why}")


def store(name: str, measured: list[dict]) -> None:
    """Put measurements in this machine's cache, as an earlier calibration would have (the
    choices stored before kept)."""
    path = calibration.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"key": calibration.machine_key(), "choices": {}}
    if path.exists():
        data = json.loads(path.read_text())
    data["choices"][name] = {"measured": measured}
    path.write_text(json.dumps(data))


def count_paths(monkeypatch) -> dict[str, int]:
    counts = {"skinny": 0, "packed": 0}
    skinny, packed = packed_linear.skinny_linear, packed_linear.PackedLinear.forward_packed

    def counted_skinny(*args, **kwargs):
        counts["skinny"] += 1
        return skinny(*args, **kwargs)

    def counted_packed(self, x):
        counts["packed"] += 1
        return packed(self, x)

    monkeypatch.setattr(packed_linear, "skinny_linear", counted_skinny)
    monkeypatch.setattr(packed_linear.PackedLinear, "forward_packed", counted_packed)
    return counts

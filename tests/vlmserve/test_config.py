"""`--dtype auto` (vlmserve.config.choose_dtype) and the checkpoint dtype it reads."""

from __future__ import annotations

import json

import pytest
import torch

from vlmserve.config import ModelConfig, checkpoint_dtype, choose_dtype, kv_cache_torch_dtype


@pytest.mark.parametrize(
    ("requested", "device", "marked", "native", "want"),
    [
        ("auto", "cpu", "bfloat16", "avx512_bf16", torch.bfloat16),
        ("auto", "cpu", "bfloat16", "amx_bf16", torch.bfloat16),
        ("auto", "cpu", "float16", "avx512_bf16", torch.bfloat16),  # 16-bit: bf16 on a CPU
        ("auto", "cpu", "bfloat16", None, torch.float32),  # no native bf16: float32
        ("auto", "cpu", "float32", "avx512_bf16", torch.float32),  # float32 stays exact
        ("auto", "cpu", None, "avx512_bf16", torch.float32),
        ("auto", "cuda", "float16", None, torch.float16),  # a GPU: the checkpoint's
        ("auto", "cuda", "bfloat16", None, torch.bfloat16),
        ("auto", "cuda", "float32", None, torch.bfloat16),
        ("float32", "cpu", "bfloat16", "avx512_bf16", torch.float32),  # explicit wins
        ("bfloat16", "cpu", "float32", None, torch.bfloat16),
    ],
)
def test_choose_dtype(requested, device, marked, native, want):
    choice = choose_dtype(requested, device, marked, native)
    assert choice.dtype == want
    assert choice.reason  # said why (vlmserve info, the start-up log)


def test_checkpoint_dtype_reads_either_key_and_the_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "float16"}}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_dtype(tmp_path) is None


def test_bad_dtypes_are_named(tmp_path):
    with pytest.raises(ValueError, match="float8"):
        ModelConfig(str(tmp_path), dtype="float8")
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("float32", torch.bfloat16) == torch.float32

"""The runner's dtype checks at start-up: the dtype picked and why, the warning where a
CPU has no native bfloat16, and the backends that read a cache of another dtype."""

from __future__ import annotations

import logging

import torch

from kernels.cpu_build import native_bf16
from vlmserve.config import EngineConfig

log = logging.getLogger(__name__)


def check_dtypes(
    config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype, backend: str
) -> None:
    """Log the dtype picked and why; say once where a CPU runs bfloat16 without native
    bfloat16 (correct, but emulated: slower than float32). A KV dtype other than the
    model's is read by the CPU and torch backends only."""
    log.info("dtype %s (%s), KV cache %s", dtype, config.model.dtype_choice.reason, kv_dtype)
    if config.model.device == "cpu" and torch.bfloat16 in (dtype, kv_dtype):
        if native_bf16() is None:
            log.warning(
                "bfloat16 on a CPU without native bfloat16 (no amx_bf16 / avx512_bf16): "
                "the kernels convert to float32 and run correctly, but slower than float32"
            )
    if kv_dtype != dtype and backend not in ("cpu", "cpu-sdpa", "torch"):
        raise ValueError(
            f"--kv-cache-dtype {config.cache.kv_cache_dtype} differs from the model's {dtype}: "
            f"the {backend} attention backend reads the cache in the model's dtype only "
            "(use the cpu or torch backend, or --kv-cache-dtype auto)"
        )

"""The engine flags of issue 29 (shared by every door through engine_args.py): the
weights' dtype, the KV cache's, and the start-up warm-up."""

from __future__ import annotations

import argparse

from scheduler.config import KV_CACHE_DTYPES, CacheConfig
from vlmserve.config import DTYPE_CHOICES


def add_dtype_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="weights and activations. auto (default): the checkpoint's dtype on a GPU; on a "
        "CPU bfloat16 where the CPU has native bfloat16 (AMX or AVX-512 BF16) and the "
        "checkpoint is 16-bit, float32 otherwise (`vlmserve info --model M` says which and "
        "why). bfloat16 runs every CPU hot path with float32 accumulation; it is not "
        "token-exact with float32",
    )


def add_kv_cache_dtype_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--kv-cache-dtype",
        default=CacheConfig().kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="the KV cache's element type, independent of --dtype (default auto: the "
        "model's); bfloat16 halves the KV bytes per token",
    )


def add_warmup_arg(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the step shapes live traffic will meet (a full prefill chunk, each decode "
        "batch bucket, a small and a large image) once at start-up, bounded to ~20 s, so the "
        "first requests run as fast as later ones; default: on for serve (before /health "
        "turns 200), off elsewhere",
    )

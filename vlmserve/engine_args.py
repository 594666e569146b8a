"""Engine flags shared by the `vlmserve` subcommands that run the engine (generate, demo,
serve, caption), and the EngineConfig they build."""

from __future__ import annotations

import argparse

from scheduler.config import CacheConfig, SchedulerConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.embedded import DEFAULT_MODEL_DIR


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=str(DEFAULT_MODEL_DIR),
        help="checkpoint folder (default: the embedded model trained on generated scenes)",
    )
    group.add_argument("--device", default=None, help="cpu, cuda (default: $VLMSERVE_DEVICE)")
    group.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-images-per-request", type=int, default=16)
    group.add_argument("--kv-cache-mb", type=int, default=1024, help="KV pool size (CPU)")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="overrides the size")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--no-prefix-caching", action="store_true")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model = {"device": args.device} if args.device else {}
    return EngineConfig(
        ModelConfig(
            args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_images_per_request=args.max_images_per_request,
            **model,
        ),
        CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            memory_bytes=args.kv_cache_mb << 20,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
        ),
    )

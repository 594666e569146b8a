"""`vlmserve caption`'s command line: the flags, one process (vlmserve/cli/caption.py) or
Ray (vlmserve/cli/caption_ray.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlmserve.cli import caption as caption_job
from vlmserve.cli.caption import DEFAULT_PROMPT, CaptionItem, discover, run_caption
from vlmserve.cli.caption_json import load_schema
from vlmserve.cli.caption_ray import add_ray_args, ray_config_from_args, run_caption_ray
from vlmserve.cli.engine_args import add_engine_args, engine_config_from_args
from vlmserve.engine.core import Engine
from vlmserve.engine.stats import render_engine_stats
from vlmserve.sample.params import SamplingParams


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `caption` command."""
    p = subparsers.add_parser(
        "caption",
        help="caption a folder or JSONL of images into JSONL",
        description=caption_job.__doc__,
    )
    p.add_argument("input", help="folder of images (recursive) or JSONL of {path|url, prompt}")
    p.add_argument("--output", "-o", required=True, help="JSONL to append to (resumable)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-in-flight", type=int, default=32, help="requests kept in the engine")
    p.add_argument("--workers", type=int, default=4, help="image read / request prepare threads")
    p.add_argument("--limit", type=int, default=None, help="caption at most N items this run")
    p.add_argument("--retry-errors", action="store_true", help="rerun items that failed")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--json-schema", metavar="FILE", default=None,
        help="each caption is a JSON object following this schema (structured outputs)",
    )  # fmt: skip
    add_engine_args(p)
    add_ray_args(p)
    p.set_defaults(func=cmd_caption)


def cmd_caption(args: argparse.Namespace) -> int:
    if args.max_in_flight < 1 or args.workers < 1:
        raise ValueError("--max-in-flight and --workers must be >= 1")
    items = discover(Path(args.input), args.prompt)
    structured = load_schema(args.json_schema) if args.json_schema else None
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        structured=structured,
    )  # fmt: skip
    if args.ray is not None:
        return _cmd_caption_ray(args, items, sampling)
    engine = Engine(engine_config_from_args(args))
    summary = run_caption(
        engine, items, Path(args.output), sampling, max_in_flight=args.max_in_flight,
        num_workers=args.workers, limit=args.limit, retry_errors=args.retry_errors,
        progress=not args.no_progress,
    )  # fmt: skip
    print(summary.render(), file=sys.stderr)
    print(render_engine_stats(engine.stats()), file=sys.stderr)
    return 130 if summary.interrupted else 0


def _cmd_caption_ray(
    args: argparse.Namespace, items: list[CaptionItem], sampling: SamplingParams
) -> int:
    ray_config = ray_config_from_args(args)
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("--ray needs Ray: pip install -e '.[ray]'") from None
    summary = run_caption_ray(
        engine_config_from_args(args), items, Path(args.output), sampling, ray_config,
        max_in_flight=args.max_in_flight, num_workers=args.workers, limit=args.limit,
        retry_errors=args.retry_errors, progress=not args.no_progress,
    )  # fmt: skip
    print(summary.render(), file=sys.stderr)
    return 130 if summary.interrupted else 0

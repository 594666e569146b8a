"""``vlmserve estimate``: the article's Labs 1–4 as a command line.

``image`` (Lab 4), ``kv`` (Lab 1), ``plan`` (Lab 2), ``batching`` (Lab 3), ``capacity``
(a request trace through the real scheduler on the cost model's clock), ``pipeline``
(NanoFlow's nano-batch auto-search, search/nanoflow/auto_search.py). A table by
default, ``--json`` for scripts, ``--plot FILE.png`` for the curves the labs draw.
Every figure is a roofline model (search/), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from search.costmodel.presets import (
    ACCELERATORS,
    CACHE_PRECISIONS,
    ENCODERS,
    MODELS,
    WEIGHT_PRECISIONS,
)
from search.image_budget import TILING_RULES
from vlmserve.cli.estimate import capacity as estimate_capacity
from vlmserve.cli.estimate import labs
from vlmserve.cli.estimate import pipeline as estimate_pipeline
from vlmserve.cli.estimate.labs import Outcome, Row
from vlmserve.cli.estimate.plot import draw

# --- formatting -----------------------------------------------------------------------


def _table(title: str, rows: list[Row]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join([title, *(f"  {label:<{width}}  {value}" for label, value in rows)])


# --- shared arguments -----------------------------------------------------------------


def _common(default_model: str, default_workspace_gb: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--model",
        default=default_model,
        help=f"preset ({', '.join(sorted(MODELS))}) or a path to an HF config.json "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--accelerator",
        default="h100-sxm",
        help=f"{', '.join(sorted(ACCELERATORS))}, or cpu (measured now); default: %(default)s",
    )
    p.add_argument("--kv-dtype", choices=sorted(CACHE_PRECISIONS), default="bf16")
    p.add_argument(
        "--workspace-gb",
        type=float,
        default=default_workspace_gb,
        help="engine workspace kept free of cache (default: %(default)s GB)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the lab's curves to a PNG")
    return p


def _weight_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weight-dtype", choices=sorted(WEIGHT_PRECISIONS), default="bf16")


def _tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``estimate`` with its ``image``, ``kv``, ``plan``, ``batching``, ``capacity`` and
    ``pipeline`` commands."""
    estimate = subparsers.add_parser(
        "estimate",
        help="roofline cost estimates: image budget, KV cache, serving plan, batching, capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    estimate.set_defaults(func=lambda args: _usage(estimate))
    sub = estimate.add_subparsers(
        dest="estimate_command", metavar="{image,kv,plan,batching,capacity,pipeline}"
    )

    p = sub.add_parser(
        "image", parents=[_common("mha-7b", 2.0)], help="what an image costs to serve (Lab 4)"
    )
    p.add_argument("image", nargs="?", help="image file (only its header is read)")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--images", type=int, default=1, help="images per request (default: 1)")
    p.add_argument("--text-tokens", type=int, default=30, help="text tokens (default: 30)")
    p.add_argument(
        "--tiling", choices=TILING_RULES, default=None,
        help="default: the model's own (Gemma 3: single, one 896 px tile; pan-and-scan: "
        "plus its crops, the engine's --pan-and-scan), else dynamic",
    )  # fmt: skip
    p.add_argument(
        "--max-tiles",
        type=int,
        default=12,
        help="dynamic: most crops (a thumbnail is added); fixed: tiles per image (default: 12)",
    )
    p.add_argument(
        "--encoder", default=None,
        help=f"{', '.join(sorted(ENCODERS))} (default: the model's own, else siglip-so400m-14-384)",
    )  # fmt: skip
    p.add_argument(
        "--pooling", type=int, default=None,
        help="connector ratio N:1 (default: the model's own, Gemma 3 16, else 4)",
    )  # fmt: skip
    p.add_argument("--preprocess-ms-per-tile", type=float, default=1.2)
    p.set_defaults(func=lambda args: _run(args, labs.run_image))

    p = sub.add_parser("kv", parents=[_common("llama-3-8b", 0.0)], help="KV cache (Lab 1)")
    _weight_arg(p)
    _tp_arg(p)
    p.add_argument("--context", type=int, default=8192, help="tokens (default: 8192)")
    p.add_argument("--batch", type=int, default=8, help="concurrent sequences (default: 8)")
    p.set_defaults(func=lambda args: _run(args, labs.run_kv))

    p = sub.add_parser("plan", parents=[_common("llama-3-8b", 2.0)], help="serving plan (Lab 2)")
    _weight_arg(p)
    _tp_arg(p)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.set_defaults(func=lambda args: _run(args, labs.run_plan))

    p = sub.add_parser(
        "batching", parents=[_common("llama-3-8b", 2.0)], help="batching limits (Lab 3)"
    )
    _weight_arg(p)
    _tp_arg(p)
    p.add_argument("--context", type=int, default=8192, help="tokens (default: 8192)")
    p.set_defaults(func=lambda args: _run(args, labs.run_batching))

    p = sub.add_parser(
        "capacity",
        parents=[_common("mha-7b", 2.0)],
        help="simulate a request trace: latency percentiles, goodput, max rate at an SLO",
    )
    estimate_capacity.add_arguments(p)
    p.set_defaults(func=lambda args: _run(args, estimate_capacity.run_capacity))

    p = sub.add_parser(
        "pipeline",
        parents=[_common("llama-3-8b", 2.0)],
        help="NanoFlow auto-search: the nano-batch schedule of one layer (--plot: Gantt)",
        description=estimate_pipeline.__doc__,
    )
    _tp_arg(p)
    estimate_pipeline.add_arguments(p)
    p.set_defaults(func=estimate_pipeline.run_pipeline)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    choices = "image, kv, plan, batching, capacity, pipeline"
    print(f"vlmserve estimate: error: choose one of {choices}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace, command: Callable[[argparse.Namespace], Outcome]) -> int:
    """Resolve, compute, print; user errors become one stderr line and exit code 2."""
    name = args.estimate_command
    try:
        plot = Path(args.plot) if args.plot else None
        if plot is not None and plot.suffix.lower() != ".png":
            raise ValueError(f"--plot wants a .png file, got {args.plot}")
        if plot is not None and not plot.parent.is_dir():
            raise ValueError(f"--plot folder does not exist: {plot.parent}")
        if args.workspace_gb < 0:
            raise ValueError(f"--workspace-gb must be >= 0, got {args.workspace_gb}")
        payload, rows, curves = command(args)
        if plot is not None:
            draw(plot, payload["title"], curves())
    except (ValueError, OSError) as exc:
        print(f"vlmserve estimate {name}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"command": name, **payload}, indent=2))
    else:
        print(_table(payload["title"], rows))
    if plot is not None:
        print(f"wrote {plot}", file=sys.stderr)
    return 0

"""``vlmserve estimate``'s Labs 1–4 (image, kv, plan, batching): each command computes its
JSON payload, table rows and plot curves from the cost model (vlmserve/cli/estimate/main.py
parses and prints)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from scheduler.config import seq_peak_blocks
from search.costmodel import cost_model as cm
from search.costmodel.labs import batching_limits, kv_report, serving_plan
from search.costmodel.presets import (
    MODEL_VISION,
    Accelerator,
    ModelShape,
    get_accelerator,
    get_cache_precision,
    get_encoder,
    get_model,
    get_weight_precision,
)
from search.image_budget import (
    ImageAssumptions,
    TileGrid,
    image_budget,
    tile_image,
)
from search.sim.step_time import kv_layers_per_block, kv_windows
from vlmserve.cli.estimate.plot import Curve

Row = tuple[str, str]


# A command returns its JSON payload, its table rows and (lazily) its plot's curves.
Outcome = tuple[dict[str, Any], list[Row], Callable[[], list[Curve]]]

_CONTEXTS = [2**k for k in range(9, 18)]  # 512 … 131,072 tokens: the labs' sweep


# --- formatting -----------------------------------------------------------------------


def _bytes(b: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit}" if b < 100 * scale else f"{b / scale:,.0f} {unit}"
    return f"{b:.0f} B"


def _time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


def _setup(args: argparse.Namespace) -> tuple[ModelShape, Accelerator]:
    return get_model(args.model), get_accelerator(args.accelerator)


def _payload(
    title: str, args: argparse.Namespace, model: ModelShape, accel: Accelerator, result: Any
) -> dict[str, Any]:
    """The JSON document: what was asked (the parsed options), the shapes used, the result."""
    skip = {"func", "json", "plot", "estimate_command"}
    return {
        "title": title,
        "inputs": {k: v for k, v in vars(args).items() if k not in skip},
        "model": dataclasses.asdict(model) | {"num_params": model.num_params},
        "accelerator": dataclasses.asdict(accel),
        "results": dataclasses.asdict(result),
    }


# --- image (Lab 4) --------------------------------------------------------------------


def read_image_size(path: str) -> tuple[int, int]:
    """(width, height) as displayed, from the header only: PIL's open() is lazy and never
    decodes pixels; an EXIF rotation of 90° swaps the sides as the preprocessor will."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            width, height = im.size
            orientation = im.getexif().get(0x0112, 1)
    except (OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"cannot read image {path}: {exc}") from exc
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def run_image(args: argparse.Namespace) -> Outcome:
    model, accel = _setup(args)
    own_encoder, own_pooling = MODEL_VISION.get(model.name, ("siglip-so400m-14-384", 4))
    args.encoder = args.encoder or own_encoder
    args.pooling = own_pooling if args.pooling is None else args.pooling
    args.tiling = args.tiling or ("single" if model.name in MODEL_VISION else "dynamic")
    encoder = get_encoder(args.encoder)
    if args.image and (args.width is not None or args.height is not None):
        raise ValueError("give either an image file or --width/--height, not both")
    if (args.width is None) != (args.height is None):
        raise ValueError("--width and --height go together")
    width, height = read_image_size(args.image) if args.image else (args.width, args.height)
    if width is not None and (width < 1 or height < 1):
        raise ValueError(f"image size must be positive, got {width}x{height}")
    grid = tile_image(width, height, args.tiling, args.max_tiles, encoder.image_size)
    assumptions = ImageAssumptions(
        preprocess_s_per_tile=args.preprocess_ms_per_tile * 1e-3,
        workspace_bytes=args.workspace_gb * 1e9,
    )
    cache = get_cache_precision(args.kv_dtype)

    budget_for = functools.partial(
        image_budget,
        encoder=encoder,
        model=model,
        accel=accel,
        text_tokens=args.text_tokens,
        pooling_ratio=args.pooling,
        cache_bytes=cache.bytes_per_element,
        assumptions=assumptions,
    )
    b = budget_for(grid, images_per_request=args.images)
    thumb = " + thumbnail" if grid.thumbnail else ""
    size = f"{width} x {height}" if width is not None else "not needed (fixed tiling)"
    layout = f"{grid.cols} x {grid.rows}{thumb} = {b.tiles_per_image} tiles"
    if args.tiling == "pan-and-scan":  # Gemma 3: the whole image first, then its crops
        num_crops = grid.cols * grid.rows if grid.thumbnail else 0
        layout = f"whole image + {num_crops} crops = {b.tiles_per_image} tiles"
    rows: list[Row] = [
        ("image size", size),
        ("tile grid", layout),
        ("patch tokens", f"{b.patch_tokens_per_image:,} per image"),
        ("visual tokens", f"{b.visual_tokens_per_image:,} per image ({args.pooling}:1 pooling)"),
        (
            "prompt tokens",
            f"{b.prompt_tokens:,} ({b.num_images} image(s) + {args.text_tokens} text)",
        ),
        ("preprocess (CPU)", _time(b.preprocess_s)),
        ("vision encoder", f"{_time(b.vit_s)} ({b.vit_flops / 1e12:.3g} TFLOP)"),
        ("LLM prefill", f"{_time(b.prefill_s)} ({b.prefill_flops / 1e12:.3g} TFLOP)"),
        ("TTFT", _time(b.ttft_s)),
        ("vision share of TTFT", f"{b.vision_share_of_ttft:.0%}"),
        ("KV per image", _bytes(b.kv_bytes_per_image)),
        ("KV per request", _bytes(b.kv_bytes_per_request)),
        ("concurrent conversations", f"{b.concurrent_requests:,}"),
        (
            "vs text-only prompt",
            f"{b.ttft_multiple_of_text:.0f}x TTFT ({_time(b.text_only_ttft_s)}), "
            f"{b.kv_multiple_of_text:.0f}x KV",
        ),
    ]
    title = (
        f"image budget: {model.name} ({args.kv_dtype} cache) on {accel.name}, "
        f"{encoder.name}, {args.tiling} tiling"
    )
    payload = _payload(title, args, model, accel, b)
    payload["inputs"] |= {"width": width, "height": height}
    payload |= {
        "assumptions": dataclasses.asdict(assumptions),
        "tile_grid": dataclasses.asdict(grid),
    }

    def curves() -> list[Curve]:
        tiles = list(range(1, max(13, grid.num_tiles) + 1))
        ttft = [
            budget_for(TileGrid(n, 1, False), images_per_request=args.images).ttft_s * 1e3
            for n in tiles
        ]
        images = list(range(1, 9))
        conversations = [budget_for(grid, images_per_request=n).concurrent_requests for n in images]
        return [
            Curve(tiles, ttft, "tiles per image", "TTFT (ms)", log_x=False),
            Curve(images, conversations, "images per request", "concurrent conversations", False),
        ]

    return payload, rows, curves


# --- kv (Lab 1) -----------------------------------------------------------------------


def run_kv(args: argparse.Namespace) -> Outcome:
    model, accel = _setup(args)
    weight, cache = get_weight_precision(args.weight_dtype), get_cache_precision(args.kv_dtype)
    ws = args.workspace_gb * 1e9
    r = kv_report(model, accel, args.context, args.batch, weight, cache, ws, args.tp)
    rows: list[Row] = [
        ("attention", f"{model.attention_kind} (g = {model.group_size})"),
        ("KV per token", f"{r.kv_bytes_per_token / 1024:,.0f} KiB"),
        ("KV per sequence", _bytes(r.kv_bytes_per_sequence)),
        ("KV total", f"{_bytes(r.kv_bytes_total)} ({args.batch} sequences)"),
        *_hybrid_rows(model, args.context, cache.bytes_per_element),
        ("weights", _bytes(r.weight_bytes)),
        ("device used", f"{_bytes(r.device_bytes_used)} ({r.device_fraction_used:.0%})"),
        ("max concurrency", f"{r.max_concurrency:,} sequences"),
        ("KV read / decode step", _bytes(r.kv_bytes_read_per_step)),
    ]
    if args.tp > 1:
        copies = f"{r.kv_replicas} copies of each KV head" if r.kv_replicas > 1 else "no copies"
        rows[4:6] = [
            ("weights per GPU", _bytes(r.weight_bytes / args.tp)),
            (
                "device used, per GPU",
                f"{_bytes(r.device_bytes_used)} ({r.device_fraction_used:.0%})",
            ),
        ]
        rows[2:2] = [
            ("KV per token per GPU", f"{r.kv_bytes_per_token_per_device / 1024:,.0f} KiB"),
            (
                "KV heads per GPU",
                f"{max(1, model.num_kv_heads // args.tp)} of {model.num_kv_heads} ({copies})",
            ),
        ]
        if r.kv_replicas > 1:
            held = r.kv_bytes_total * r.kv_replicas
            rows.insert(6, ("KV held, all GPUs", f"{_bytes(held)} ({r.kv_replicas} copies)"))
            rows.append(("warning", f"tp={args.tp} > n_kv={model.num_kv_heads}: cache replicated"))
    title = (
        f"KV cache: {model.name}, {args.context:,} tokens, {args.weight_dtype} weights, "
        f"{args.kv_dtype} cache, tp {args.tp}, {accel.name}"
    )
    payload = _payload(title, args, model, accel, r)

    def curves() -> list[Curve]:
        s_w, s_c = weight.bytes_per_element, cache.bytes_per_element
        kv = [cm.kv_bytes_per_sequence(model, n, s_c) / 1e9 for n in _CONTEXTS]
        seqs = [cm.b_max(model, accel, n, s_w, s_c, ws) for n in _CONTEXTS]
        return [
            Curve(_CONTEXTS, kv, "context (tokens)", "KV cache per sequence (GB)"),
            Curve(_CONTEXTS, seqs, "context (tokens)", "max resident sequences"),
        ]

    return payload, rows, curves


def _hybrid_rows(model: ModelShape, context: int, cache_bytes: float) -> list[Row]:
    """Sliding-window models: what a hybrid KV manager holds against all-global layers."""
    if not model.num_sliding_layers:
        return []
    hybrid = cm.kv_bytes_per_sequence(model, context, cache_bytes)
    full = cm.kv_bytes_all_global(model, context, cache_bytes)
    return [
        (
            "sliding-window layers",
            f"{model.num_sliding_layers} of {model.num_layers}, window {model.sliding_window:,}",
        ),  # fmt: skip
        ("KV per sequence, all global", _bytes(full)),
        ("hybrid KV / all global", f"{hybrid / full:.0%}"),
        _manager_row(model, context, cache_bytes),
    ]


def _manager_row(model: ModelShape, context: int, cache_bytes: float, block: int = 16) -> Row:
    """What the engine's hybrid KV manager (scheduler/kv_blocks.py) holds for one decoding
    sequence: its pool blocks over every KV cache group (whole blocks, the +1 of a window
    that starts mid-block, a smaller last group's unused share all counted), against
    all-global layers."""
    windows, per_block = kv_windows(model), kv_layers_per_block(model)
    held = seq_peak_blocks(windows, block, context, 1)
    block_bytes = cm.kv_bytes_per_token(model, cache_bytes) / model.num_layers * per_block * block
    full = cm.kv_bytes_all_global(model, context, cache_bytes)
    return (
        f"KV manager, blocks of {block}",
        f"{held:,} blocks of {per_block} layers ({_bytes(held * block_bytes)}), "
        f"{held * block_bytes / full:.0%} of all global",
    )


# --- plan (Lab 2) ---------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> Outcome:
    model, accel = _setup(args)
    weight, cache = get_weight_precision(args.weight_dtype), get_cache_precision(args.kv_dtype)
    ws = args.workspace_gb * 1e9

    def plan_for(batch: int):
        return serving_plan(
            model, accel, args.prompt_tokens, args.output_tokens, batch, weight, cache, args.tp, ws
        )

    r = plan_for(args.batch)
    fits = "yes" if r.fits else "NO"
    rows: list[Row] = [
        ("fits?", f"{fits} ({_bytes(r.device_bytes_used)} of {_bytes(accel.memory_bytes)})"),
        ("TTFT", _time(r.ttft_s)),
        ("TPOT", _time(r.tpot_s)),
        ("E2E latency", _time(r.e2e_s)),
        ("output tok/s, all seqs", f"{r.tokens_per_s_total:,.0f}"),
        ("per-user tok/s", f"{r.tokens_per_s_per_user:,.0f}"),
        ("KV share of step bytes", f"{r.kv_share_of_step_bytes:.0%}"),
        ("decode intensity", f"{r.decode_intensity:.1f} FLOP/byte"),
    ]
    if r.cache_replicated:
        rows.append(("warning", f"tp={args.tp} > n_kv={model.num_kv_heads}: cache replicated"))
    title = (
        f"serving plan: {model.name}, {args.prompt_tokens:,} in / {args.output_tokens:,} out, "
        f"batch {args.batch}, tp {args.tp}, {accel.name}"
    )
    payload = _payload(title, args, model, accel, r)

    def curves() -> list[Curve]:
        batches = [2**k for k in range(0, 11)]
        plans = [plan_for(b) for b in batches]
        return [
            Curve(batches, [p.tpot_s * 1e3 for p in plans], "batch", "TPOT (ms)"),
            Curve(batches, [p.tokens_per_s_total for p in plans], "batch", "output tok/s, all"),
        ]

    return payload, rows, curves


# --- batching (Lab 3) -----------------------------------------------------------------


def run_batching(args: argparse.Namespace) -> Outcome:
    model, accel = _setup(args)
    weight, cache = get_weight_precision(args.weight_dtype), get_cache_precision(args.kv_dtype)
    ws = args.workspace_gb * 1e9
    r = batching_limits(model, accel, args.context, weight, cache, args.tp, ws)
    at_max = (
        "n/a (nothing fits)"
        if r.intensity_at_b_max is None
        else (f"{r.intensity_at_b_max:.1f} FLOP/byte")
    )
    tr = "n/a" if r.nanoflow_tr_at_b_max is None else f"{r.nanoflow_tr_at_b_max:.2f}"
    rows: list[Row] = [
        ("B* (arithmetic)", f"{r.b_star:,.0f}"),
        ("B_cross (KV = weights)", f"{r.b_cross:,.1f}"),
        ("B_max (capacity)", f"{r.b_max:,}"),
        ("I at B_max", at_max),
        ("I ceiling (B -> inf)", f"{r.intensity_ceiling:.1f} FLOP/byte"),
        ("ceiling as % of peak", f"{r.ceiling_fraction_of_peak:.1%}"),
        ("throughput ceiling", f"{r.throughput_ceiling:,.0f} tok/s"),
        ("NanoFlow optimum", f"{r.optimal_throughput:,.0f} tok/s (TR at B_max {tr})"),
    ]
    title = (
        f"batching limits: {model.name}, {args.context:,} tokens, {args.weight_dtype} weights, "
        f"{args.kv_dtype} cache, tp {args.tp}, {accel.name}"
    )
    payload = _payload(title, args, model, accel, r)

    def curves() -> list[Curve]:
        s_w, s_c = weight.bytes_per_element, cache.bytes_per_element
        batches = [2**k for k in range(0, 15)]
        intensity = [cm.decode_intensity(model, args.context, b, s_w, s_c) for b in batches]
        limits = ((r.b_star, "B*"), (r.b_cross, "B_cross"), (float(r.b_max), "B_max"))
        ceilings = (
            (r.intensity_ceiling, "I ceiling"),
            (accel.ridge(weight.compute_dtype), "ridge"),
        )
        marks = tuple((x, label) for x, label in limits if x > 0)
        ylabel = "decode intensity I(B) (FLOP/byte)"
        return [Curve(batches, intensity, "batch", ylabel, True, True, ceilings, marks)]

    return payload, rows, curves

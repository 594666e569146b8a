"""What an image costs to serve (article §17, Lab 4): tiles → patch tokens → visual
tokens → preprocess / ViT / prefill times → TTFT, KV per request, concurrency.

Pure functions; the visual-token count is known from the image size alone, before any
pixel is decoded, which is what lets admission price an image up front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from encoders.tiling.grid import internvl_grid
from encoders.tiling.pan_and_scan import pan_and_scan_crops
from search.costmodel import cost_model as cm
from search.costmodel.presets import Accelerator, ModelShape, VisionEncoder

TilingRule = Literal["dynamic", "fixed", "single", "pan-and-scan"]
TILING_RULES: tuple[TilingRule, ...] = ("dynamic", "fixed", "single", "pan-and-scan")
# Gemma3Processor's pan-and-scan settings (its images_kwargs defaults, the released ones).
PAN_AND_SCAN = dict(min_crop_size=256, max_crops=4, min_ratio=1.2)


@dataclass(frozen=True)
class TileGrid:
    """cols × rows crops, plus one global thumbnail when the grid has more than one crop."""

    cols: int
    rows: int
    thumbnail: bool

    @property
    def num_tiles(self) -> int:
        return self.cols * self.rows + int(self.thumbnail)


def dynamic_grid(width: int, height: int, max_tiles: int, tile_size: int) -> tuple[int, int]:
    """InternVL-1.5 rule: the (cols, rows) with cols·rows ≤ max_tiles closest in aspect
    ratio to the image; a tie goes to the larger grid if the image has the pixels for it.

    Delegates to the preprocessor's own rule so the estimate and the engine count the same
    tiles for the same header.
    """
    return internvl_grid(width, height, image_size=tile_size, max_num=max_tiles)


def tile_image(
    width: int | None, height: int | None, rule: TilingRule, max_tiles: int, tile_size: int
) -> TileGrid:
    """The grid a tiling rule gives. ``fixed`` is Lab 4's slider: every image is max_tiles
    tiles (thumbnail included) whatever its size; ``single`` resizes to one tile;
    ``pan-and-scan`` is Gemma 3's (the engine's rule, `encoders.tiling.pan_and_scan`): the
    whole image (the "thumbnail") plus its crops, when the image is elongated enough."""
    if max_tiles < 1:
        raise ValueError(f"max tiles must be >= 1, got {max_tiles}")
    if rule == "single":
        return TileGrid(1, 1, False)
    if rule == "fixed":
        return TileGrid(max_tiles, 1, False)
    if rule == "pan-and-scan":
        if width is None or height is None:
            raise ValueError("pan-and-scan needs the image size (an image or width/height)")
        crops = pan_and_scan_crops(width, height, **PAN_AND_SCAN)
        if not crops:
            return TileGrid(1, 1, False)
        cols, rows = len({box[0] for box in crops}), len({box[1] for box in crops})
        return TileGrid(cols, rows, thumbnail=True)
    if rule != "dynamic":
        raise ValueError(f"unknown tiling rule {rule!r}; choose one of {', '.join(TILING_RULES)}")
    if width is None or height is None:
        raise ValueError("the dynamic tiling rule needs the image size (an image or width/height)")
    cols, rows = dynamic_grid(width, height, max_tiles, tile_size)
    return TileGrid(cols, rows, thumbnail=cols * rows > 1)


@dataclass(frozen=True)
class ImageAssumptions:
    """Lab 4's modelling constants: the crudest numbers in the estimate."""

    vit_efficiency: float = 0.40  # ViT at 40% of dense peak
    prefill_efficiency: float = 0.45  # LLM prefill at 45%
    preprocess_s_per_tile: float = 1.2e-3  # CPU decode + resize + crop, per tile
    weight_bytes: float = 2.0  # backbone (and tower) in bf16
    workspace_bytes: float = 2e9

    def __post_init__(self) -> None:
        for name in ("vit_efficiency", "prefill_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.preprocess_s_per_tile < 0 or self.workspace_bytes < 0:
            raise ValueError("preprocess time and workspace must be >= 0")


@dataclass(frozen=True)
class ImageBudget:
    """Lab 4's outputs for one request; bytes and seconds."""

    tiles_per_image: int
    patch_tokens_per_image: int
    visual_tokens_per_image: int
    num_images: int
    prompt_tokens: int
    preprocess_s: float
    vit_flops: float
    vit_s: float
    prefill_flops: float
    prefill_s: float
    ttft_s: float
    vision_share_of_ttft: float
    kv_bytes_per_image: float
    kv_bytes_per_request: float
    concurrent_requests: int
    text_only_ttft_s: float
    ttft_multiple_of_text: float
    kv_multiple_of_text: float


def visual_tokens(patch_tokens: int, pooling_ratio: int) -> int:
    """Tokens after the connector. §17 divides the image's total: 9,477 / 4 ≈ 2,370; a
    per-tile 2×2 pool of a 27×27 grid would round up to 14² per tile (2,548)."""
    return math.ceil(patch_tokens / pooling_ratio)


def vit_flops(encoder: VisionEncoder, num_tiles: int) -> float:
    """2·P_vit·N + 4·L_vit·T²·d_vit per tile, bidirectional attention (§17, Lab 4)."""
    t = encoder.tokens_per_tile
    linear = 2 * encoder.num_params * t * num_tiles
    return linear + 4 * encoder.num_layers * t * t * encoder.hidden_size * num_tiles


def image_budget(
    grid: TileGrid,
    encoder: VisionEncoder,
    model: ModelShape,
    accel: Accelerator,
    images_per_request: int = 1,
    text_tokens: int = 30,
    pooling_ratio: int = 4,
    cache_bytes: float = 2.0,
    assumptions: ImageAssumptions = ImageAssumptions(),
) -> ImageBudget:
    """Lab 4: one request with ``images_per_request`` images of the same grid."""
    if images_per_request < 1:
        raise ValueError(f"images per request must be >= 1, got {images_per_request}")
    if text_tokens < 1:
        raise ValueError(f"text tokens must be >= 1, got {text_tokens}")
    if pooling_ratio < 1:
        raise ValueError(f"pooling ratio must be >= 1, got {pooling_ratio}")
    a = assumptions
    tiles = grid.num_tiles
    patch = tiles * encoder.tokens_per_tile
    visual = visual_tokens(patch, pooling_ratio)
    prompt = images_per_request * visual + text_tokens
    peak = accel.peak_flops("bf16")

    preprocess = images_per_request * tiles * a.preprocess_s_per_tile
    w_vit = images_per_request * vit_flops(encoder, tiles)
    t_vit = cm.compute_time(w_vit, peak, a.vit_efficiency)
    # "full" attention term: the variant that reproduces §17's 36.6 TFLOP (see prefill_flops).
    w_prefill = cm.prefill_flops(model, prompt, attention="full")
    t_prefill = cm.compute_time(w_prefill, peak, a.prefill_efficiency)
    ttft = preprocess + t_vit + t_prefill
    text_ttft = cm.compute_time(
        cm.prefill_flops(model, text_tokens, attention="full"), peak, a.prefill_efficiency
    )

    kv_request = cm.kv_bytes_per_sequence(model, prompt, cache_bytes)
    # The ledger holds the backbone and the tower (400M in bf16 is the 0.8 GB that turns
    # §17's 80 − 14 − 2 = 64 GB into its "roughly 63 GB free").
    resident = (model.num_params + encoder.num_params) * a.weight_bytes + a.workspace_bytes
    free = accel.memory_bytes - resident
    return ImageBudget(
        tiles_per_image=tiles,
        patch_tokens_per_image=patch,
        visual_tokens_per_image=visual,
        num_images=images_per_request,
        prompt_tokens=prompt,
        preprocess_s=preprocess,
        vit_flops=w_vit,
        vit_s=t_vit,
        prefill_flops=w_prefill,
        prefill_s=t_prefill,
        ttft_s=ttft,
        # Everything before the LLM runs: CPU preprocessing and the tower.
        vision_share_of_ttft=(preprocess + t_vit) / ttft,
        kv_bytes_per_image=cm.kv_bytes_per_sequence(model, visual, cache_bytes),
        kv_bytes_per_request=kv_request,
        concurrent_requests=max(0, math.floor(free / kv_request)),
        text_only_ttft_s=text_ttft,
        ttft_multiple_of_text=ttft / text_ttft,
        kv_multiple_of_text=prompt / text_tokens,
    )

"""Connectors from SigLIP tile features to decoder-space image tokens, as transformers does
them: LLaVA-OneVision (MLP projector, anyres grid packing with unpadding, image_newline)
and Idefics3 / SmolVLM (pixel shuffle + linear projection)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.packed_linear import Activation, linear_act

# HF `projector_hidden_act` -> module (ACT2FN equivalents that are exactly the same op)
_PROJECTOR_ACTS = {
    "gelu": lambda: nn.GELU(),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
    "silu": lambda: nn.SiLU(),
}
# The ones a packed linear_1 applies in its epilogue (the same functions as above).
_FUSED_ACTS: dict[str, Activation] = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


class LlavaOnevisionProjector(nn.Module):
    """`multi_modal_projector`: linear_1 -> act -> linear_2, applied per patch feature."""

    def __init__(
        self,
        vision_dim: int,
        text_dim: int,
        act: str,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if act not in _PROJECTOR_ACTS:
            raise ValueError(
                f"projector_hidden_act {act!r} is not supported "
                f"(supported: {sorted(_PROJECTOR_ACTS)})"
            )
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias, dtype=dtype, device=device)
        self.act = _PROJECTOR_ACTS[act]()
        self.fused_act = _FUSED_ACTS.get(act)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias, dtype=dtype, device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # [..., vision_dim] -> [..., text_dim]
        if self.fused_act is None:
            return self.linear_2(self.act(self.linear_1(features)))
        return self.linear_2(linear_act(self.linear_1, features, self.fused_act))


def select_best_resolution(
    image_size: tuple[int, int], grid_pinpoints: Sequence[Sequence[int]]
) -> tuple[int, int]:
    """The (height, width) pinpoint that keeps the most of the image and wastes the least
    (transformers' `select_best_resolution`, same tie-breaking)."""
    height, width = image_size
    best_fit: tuple[int, int] | None = None
    max_effective, min_wasted = 0, float("inf")
    for fit_height, fit_width in grid_pinpoints:
        scale = min(fit_width / width, fit_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = fit_width * fit_height - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted = effective, wasted
            best_fit = (fit_height, fit_width)
    assert best_fit is not None, f"no grid pinpoint fits image size {image_size}"
    return best_fit


def anyres_grid_shape(
    image_size: tuple[int, int], grid_pinpoints: Sequence[Sequence[int]], tile_size: int
) -> tuple[int, int]:
    """(rows, cols) of the anyres tile grid for an image of `image_size` (height, width)."""
    best_height, best_width = select_best_resolution(image_size, grid_pinpoints)
    return best_height // tile_size, best_width // tile_size


def max_patches_from_aspect_ratio(vision_aspect_ratio: str) -> int:
    """'anyres_max_9' -> 9 (the cap on unpadded features, in base-tile units)."""
    if not vision_aspect_ratio.startswith("anyres_max_"):
        raise ValueError(
            f"vision_aspect_ratio {vision_aspect_ratio!r} is not supported "
            "(expected 'anyres_max_N')"
        )
    return int(vision_aspect_ratio[len("anyres_max_") :])


def unpad_features(features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """Crop the rows/cols of the feature map that cover the letterbox padding.

    features: [C, H, W]. Rounds with `int(round(x, 7))` as transformers does (plain `int()`
    differs for some sizes and would change the token count)."""
    original_height, original_width = image_size
    current_height, current_width = features.shape[1:]
    if original_width / original_height > current_width / current_height:
        new_height = int(round(original_height * (current_width / original_width), 7))
        padding = (current_height - new_height) // 2
        return features[:, padding : current_height - padding, :]
    new_width = int(round(original_width * (current_height / original_height), 7))
    padding = (current_width - new_width) // 2
    return features[:, :, padding : current_width - padding]


def pack_anyres(
    tile_features: torch.Tensor,
    image_size: tuple[int, int],
    grid_pinpoints: Sequence[Sequence[int]],
    tile_size: int,
    max_num_patches: int,
    image_newline: torch.Tensor,
) -> torch.Tensor:
    """One image's projected tile features -> its tokens in prompt order.

    tile_features: [num_tiles, side*side, C], tile 0 the base (whole-image) tile, the rest the
    anyres grid row-major. Returns [num_tokens, C]: base tile tokens, then the unpadded (and,
    past `max_num_patches` tiles' worth, bilinearly shrunk) grid row by row, each row
    followed by `image_newline`. A single tile gives its tokens plus one newline.
    """
    num_tiles, num_patches, channels = tile_features.shape
    if num_tiles == 1:
        return torch.cat((tile_features[0], image_newline[None].to(tile_features)), dim=0)
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(
            f"anyres packing needs a square patch grid per tile, got {num_patches} features "
            "(vision_feature_select_strategy='default' only works for single-tile images)"
        )
    rows, cols = anyres_grid_shape(image_size, grid_pinpoints, tile_size)
    if rows * cols != num_tiles - 1:
        raise ValueError(
            f"image of size {tuple(image_size)} needs 1 + {rows}x{cols} tiles, got {num_tiles}"
        )
    base, grid = tile_features[0], tile_features[1:]
    # [rows*cols, side*side, C] -> [C, rows*side, cols*side]
    grid = grid.view(rows, cols, side, side, channels).permute(4, 0, 2, 1, 3)
    grid = grid.reshape(channels, rows * side, cols * side)
    grid = unpad_features(grid, image_size)
    _, height, width = grid.shape
    ratio = math.sqrt(height * width / (max_num_patches * side**2))
    if ratio > 1.1:
        size = [int(height // ratio), int(width // ratio)]
        grid = F.interpolate(grid[None], size, mode="bilinear")[0]
    # [C, h, w] -> [C, h, w + 1]: a newline column closes every row
    newline = image_newline[:, None, None].to(grid).expand(*grid.shape[:-1], 1)
    grid = torch.cat((grid, newline), dim=-1)
    return torch.cat((base, grid.flatten(1, 2).transpose(0, 1)), dim=0)  # [num_tokens, C]


def anyres_num_tokens(
    num_tiles: int,
    num_patches: int,
    image_size: tuple[int, int],
    grid_pinpoints: Sequence[Sequence[int]],
    tile_size: int,
    max_num_patches: int,
) -> int:
    """Rows `pack_anyres` returns, from shapes only (no features needed)."""
    if num_tiles == 1:
        return num_patches + 1
    side = math.isqrt(num_patches)
    rows, cols = anyres_grid_shape(image_size, grid_pinpoints, tile_size)
    height, width = rows * side, cols * side
    original_height, original_width = image_size
    if original_width / original_height > width / height:
        new_height = int(round(original_height * (width / original_width), 7))
        height -= (height - new_height) // 2 * 2
    else:
        new_width = int(round(original_width * (height / original_height), 7))
        width -= (width - new_width) // 2 * 2
    ratio = math.sqrt(height * width / (max_num_patches * side**2))
    if ratio > 1.1:
        height, width = int(height // ratio), int(width // ratio)
    return num_patches + height * (width + 1)


def pixel_shuffle(features: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """Space-to-depth over each tile's square patch grid, Idefics3 order.

    [T, side*side, D] -> [T, (side/s)^2, s*s*D]; tokens row-major over the (side/s)^2 grid,
    channels ordered (dh, dw, c). (`F.pixel_unshuffle` would order them (c, dh, dw).)
    """
    num_tiles, num_patches, dim = features.shape
    side = math.isqrt(num_patches)
    if side * side != num_patches or side % scale_factor:
        raise ValueError(
            f"pixel shuffle by {scale_factor} needs a square grid with side divisible by it, "
            f"got {num_patches} patches"
        )
    out_side = side // scale_factor
    # [T, H/s, s(dh), W/s, s(dw), D] -> [T, H/s, W/s, dh, dw, D]
    x = features.view(num_tiles, out_side, scale_factor, out_side, scale_factor, dim)
    x = x.permute(0, 1, 3, 2, 4, 5)
    return x.reshape(num_tiles, out_side * out_side, scale_factor * scale_factor * dim)


class Idefics3Connector(nn.Module):
    """Pixel shuffle by `scale_factor`, then `modality_projection.proj` (no bias)."""

    def __init__(
        self,
        vision_dim: int,
        text_dim: int,
        scale_factor: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        in_dim = vision_dim * scale_factor**2
        self.proj = nn.Linear(in_dim, text_dim, bias=False, dtype=dtype, device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # [T, P, D] -> [T, P / s^2, text_dim]
        return self.proj(pixel_shuffle(features, self.scale_factor))


class Gemma3Projector(nn.Module):
    """Gemma 3's `multi_modal_projector`: the tile's patch grid average-pooled to
    `tokens_per_image` (a square), a `(1 + weight)` RMSNorm, then a bias-free projection
    stored as [vision_dim, text_dim] (`mm_input_projection_weight`)."""

    def __init__(
        self,
        vision_dim: int,
        text_dim: int,
        patches_per_side: int,
        tokens_per_image: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        side = math.isqrt(tokens_per_image)
        if side * side != tokens_per_image or patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image={tokens_per_image} must be a square whose side divides "
                f"the {patches_per_side}-patch side of a tile"
            )
        self.patches_per_side, self.kernel, self.eps = (
            patches_per_side,
            patches_per_side // side,
            eps,
        )
        self.norm_weight = nn.Parameter(torch.empty(vision_dim, dtype=dtype, device=device))
        self.projection = nn.Parameter(
            torch.empty(vision_dim, text_dim, dtype=dtype, device=device)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # [T, P, D] -> [T, D, side, side] -> pooled [T, tokens, D] -> [T, tokens, text_dim]
        tiles, _, dim = features.shape
        grid = features.transpose(1, 2).reshape(tiles, dim, self.patches_per_side, -1)
        pooled = (
            F.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        )
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (x * (1.0 + self.norm_weight.float())).to(pooled.dtype)
        return torch.matmul(x, self.projection).to(features.dtype)

"""What a checkpoint does to an image before its vision tower, as one frozen record.

`ImageSpec` is read once from the checkpoint's HF processor and then drives everything
on our side: the tiling layout and exact token count from the image's header size, the
worker-side resize/tile (`encoders.image_io`), the on-device normalisation
(`encoders.stage`), the prompt's placeholder text, and the encoder-cache key.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Literal

from encoders.connectors import max_patches_from_aspect_ratio
from encoders.tiling.anyres import AnyresLayout, anyres_layout
from encoders.tiling.idefics3 import Idefics3Layout, idefics3_layout
from encoders.tiling.internvl import InternVLLayout, internvl_layout
from encoders.tiling.pan_and_scan import PanAndScanLayout, gemma3_prompt_text, pan_and_scan_layout

__all__ = ["ImageLayout", "ImageSpec", "placeholder_text"]

ImageLayout = AnyresLayout | Idefics3Layout | InternVLLayout | PanAndScanLayout
SpecFamily = Literal["llava_onevision", "idefics3", "internvl", "gemma3"]

# Idefics3 / SmolVLM prompt tokens (fixed strings in the HF processors)
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"


@dataclass(frozen=True)
class ImageSpec:
    """Processing settings of one family/checkpoint. Hashable; part of the cache key."""

    family: SpecFamily
    tile_size: int
    resample: int  # PIL.Image.Resampling value
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255
    # LLaVA-OneVision
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    num_patches: int = 0  # tokens of one tile (processor.num_image_tokens)
    max_num_patches: int = 9
    select_strategy: str = "full"
    # Idefics3 / SmolVLM
    longest_edge: int = 0
    do_image_splitting: bool = True
    image_seq_len: int = 0
    # InternVL dynamic tiling (the embedded default model); Gemma 3 (its image_seq_length)
    tokens_per_tile: int = 0
    min_num_tiles: int = 1
    max_num_tiles: int = 12
    use_thumbnail: bool = True
    # Gemma 3: pan-and-scan (the processor's images_kwargs) and its prompt's marker tokens
    pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio: float = 1.2
    boi_token: str = ""
    eoi_token: str = ""
    image_soft_token: str = ""
    # Decoding: JPEG draft mode (DCT-domain downscale) changes pixels, and so some
    # outputs (benchmarks/engine/jpeg_draft_divergence.py): opt-in.
    jpeg_draft: bool = False

    def __post_init__(self) -> None:
        if self.tile_size < 1:
            raise ValueError(f"tile_size={self.tile_size} must be positive")
        if self.family == "llava_onevision" and (not self.grid_pinpoints or self.num_patches < 1):
            raise ValueError("LLaVA-OneVision needs grid_pinpoints and num_patches")
        if self.family == "idefics3" and (self.longest_edge < 1 or self.image_seq_len < 1):
            raise ValueError("Idefics3 needs longest_edge and image_seq_len")
        if self.family == "internvl" and self.tokens_per_tile < 1:
            raise ValueError("InternVL needs tokens_per_tile")
        if self.family == "gemma3":
            if self.tokens_per_tile < 1 or not (
                self.boi_token and self.eoi_token and self.image_soft_token
            ):
                raise ValueError("Gemma 3 needs tokens_per_tile and its three image tokens")
            if self.pan_and_scan_min_crop_size < 1 or self.pan_and_scan_max_num_crops < 1:
                raise ValueError(
                    f"pan-and-scan min crop size {self.pan_and_scan_min_crop_size} and max "
                    f"crops {self.pan_and_scan_max_num_crops} must be positive"
                )

    def layout(self, width: int, height: int, multi_image: bool = False) -> ImageLayout:
        """Tiles and exact token count of a width x height image (header size suffices)."""
        if self.family == "llava_onevision":
            return anyres_layout(
                width, height, tile_size=self.tile_size, grid_pinpoints=self.grid_pinpoints,
                num_patches=self.num_patches, max_num_patches=self.max_num_patches,
                select_strategy=self.select_strategy, multi_image=multi_image,
            )  # fmt: skip
        if self.family == "internvl":
            return internvl_layout(
                width, height, tile_size=self.tile_size, tokens_per_tile=self.tokens_per_tile,
                min_num_tiles=self.min_num_tiles, max_num_tiles=self.max_num_tiles,
                use_thumbnail=self.use_thumbnail,
            )  # fmt: skip
        if self.family == "gemma3":
            return pan_and_scan_layout(
                width, height, tokens_per_image=self.tokens_per_tile, enabled=self.pan_and_scan,
                min_crop_size=self.pan_and_scan_min_crop_size,
                max_crops=self.pan_and_scan_max_num_crops, min_ratio=self.pan_and_scan_min_ratio,
            )  # fmt: skip
        return idefics3_layout(
            width, height, longest_edge=self.longest_edge, tile_size=self.tile_size,
            tokens_per_tile=self.image_seq_len, do_image_splitting=self.do_image_splitting,
        )  # fmt: skip

    def draft_size(self, layout: ImageLayout) -> tuple[int, int]:
        """(width, height): the smallest decode that every resample target still fits in
        (JPEG draft decodes at 1/2, 1/4, 1/8 only while it stays at least this big)."""
        if isinstance(layout, AnyresLayout):
            if layout.multi_image:  # padded at full size first: no draft
                return layout.width, layout.height
            return max(layout.resized[1], self.tile_size), max(layout.resized[0], self.tile_size)
        if isinstance(layout, PanAndScanLayout):  # crops are cut at full size: no draft
            return (layout.width, layout.height) if layout.crops else (self.tile_size,) * 2
        return layout.resized[1], layout.resized[0]  # InternVL: the grid is >= the thumbnail

    def prompt_text(self, layout: ImageLayout, image_token: str) -> str:
        """What the prompt's `image_token` marker of one image expands to, exactly as the
        HF processor writes it."""
        if isinstance(layout, PanAndScanLayout):
            return gemma3_prompt_text(
                len(layout.crops), self.tokens_per_tile, boi_token=self.boi_token,
                eoi_token=self.eoi_token, image_token=self.image_soft_token,
            )  # fmt: skip
        return placeholder_text(layout, image_token)

    @property
    def key(self) -> bytes:
        """Digest of every setting that changes the pixels or the tokens."""
        return hashlib.blake2b(repr(sorted(asdict(self).items())).encode(), digest_size=16).digest()

    @classmethod
    def from_hf(
        cls, processor: object, jpeg_draft: bool = False, pan_and_scan: bool = False
    ) -> ImageSpec | None:
        """From a loaded HF processor; None when its settings are outside what we
        reproduce (then the HF image processor stays on the serving path). `pan_and_scan`:
        Gemma 3's `do_pan_and_scan` (the engine's setting, as passed to the processor)."""
        ip = getattr(processor, "image_processor", None)
        name = type(processor).__name__
        if ip is None or not all(
            getattr(ip, flag, True) for flag in ("do_resize", "do_rescale", "do_normalize")
        ):
            return None
        common = dict(
            resample=int(ip.resample), image_mean=tuple(float(v) for v in ip.image_mean),
            image_std=tuple(float(v) for v in ip.image_std),
            rescale_factor=float(ip.rescale_factor), jpeg_draft=jpeg_draft,
        )  # fmt: skip
        if name == "LlavaOnevisionProcessor":
            size = ip.size
            height, width = size.get("height"), size.get("width")
            if not height or height != width or getattr(ip, "do_center_crop", False):
                return None
            return cls(
                "llava_onevision", tile_size=int(height),
                grid_pinpoints=tuple((int(h), int(w)) for h, w in ip.image_grid_pinpoints),
                num_patches=int(processor.num_image_tokens),
                max_num_patches=max_patches_from_aspect_ratio(processor.vision_aspect_ratio),
                select_strategy=processor.vision_feature_select_strategy or "full", **common,
            )  # fmt: skip
        if name in ("Idefics3Processor", "SmolVLMProcessor"):
            if not getattr(ip, "do_pad", True) or "longest_edge" not in ip.size:
                return None
            return cls(
                "idefics3", tile_size=int(ip.max_image_size["longest_edge"]),
                longest_edge=int(ip.size["longest_edge"]),
                do_image_splitting=bool(ip.do_image_splitting),
                image_seq_len=int(processor.image_seq_len), **common,
            )  # fmt: skip
        if name == "Gemma3Processor":
            return _gemma3_spec(processor, ip, pan_and_scan, common)
        return None


def _gemma3_spec(
    processor: object, ip: object, pan_and_scan: bool, common: dict
) -> ImageSpec | None:
    """Gemma 3's spec. The processor's `images_kwargs` (its class defaults) are passed to
    its image processor on every call, so they, not the image processor's saved values,
    decide pan-and-scan; `do_pan_and_scan` is the caller's."""
    size = ip.size
    height, width = size.get("height"), size.get("width")
    tokenizer = processor.tokenizer
    if not height or height != width:
        return None
    settings = getattr(processor, "images_kwargs", {})
    return ImageSpec(
        "gemma3", tile_size=int(height), tokens_per_tile=int(processor.image_seq_length),
        pan_and_scan=pan_and_scan,
        pan_and_scan_min_crop_size=int(settings.get("pan_and_scan_min_crop_size", 256)),
        pan_and_scan_max_num_crops=int(settings.get("pan_and_scan_max_num_crops", 4)),
        pan_and_scan_min_ratio=float(settings.get("pan_and_scan_min_ratio_to_activate", 1.2)),
        boi_token=tokenizer.boi_token, eoi_token=tokenizer.eoi_token,
        image_soft_token=tokenizer.image_token, **common,
    )  # fmt: skip


def placeholder_text(layout: ImageLayout, image_token: str) -> str:
    """The prompt text one image's `<image>` expands to, exactly as the HF processor
    writes it (so tokenising the expanded prompt gives the HF token ids)."""
    if isinstance(layout, (AnyresLayout, InternVLLayout)):
        return image_token * layout.num_tokens
    tokens_per_tile = layout.num_tokens // layout.num_tiles
    tile = image_token * tokens_per_tile
    global_image = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{tile}{FAKE_IMAGE_TOKEN}"
    rows, cols = layout.grid
    if rows == 0 and cols == 0:
        return global_image
    grid = "".join(
        "".join(f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{global_image}"

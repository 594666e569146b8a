"""The vision encoder of a VLM checkpoint: SigLIP tower + the family's connector.

Families (HF architectures):
- `llava_onevision`: LlavaOnevisionForConditionalGeneration (tower state(s) before
  `post_layernorm`, MLP projector, anyres packing with unpadding and image_newline).
- `idefics3`: Idefics3ForConditionalGeneration and SmolVLMForConditionalGeneration (tower
  `last_hidden_state` after `post_layernorm`, pixel shuffle, linear projection).
- `gemma3`: Gemma3ForConditionalGeneration (tower after `post_layernorm`, average pool to
  `mm_tokens_per_image`, RMSNorm, projection); an image is its tile plus its
  pan-and-scan crops, `mm_tokens_per_image` tokens each.

Every tile of every image runs through the tower in one batched call; tiles must be full
`image_size` squares (what the HF processors produce). Idefics3 tiles that are partly
padding (a `pixel_attention_mask` that is not all ones) are not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from encoders.connectors import (
    Gemma3Projector,
    Idefics3Connector,
    LlavaOnevisionProjector,
    anyres_grid_shape,
    anyres_num_tokens,
    max_patches_from_aspect_ratio,
    pack_anyres,
)
from encoders.siglip import SiglipConfig, SiglipTower, idefics3_position_ids, load_siglip_tower
from encoders.weights import CheckpointError, load_into, take
from kernels.packed_linear import pack_linears

__all__ = ["Family", "VisionConfig", "VisionEncoder", "VisionInput", "vision_inputs_from_hf"]

Family = Literal["llava_onevision", "idefics3", "gemma3"]

ARCHITECTURES: dict[str, Family] = {
    "LlavaOnevisionForConditionalGeneration": "llava_onevision",
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "idefics3",
    "Gemma3ForConditionalGeneration": "gemma3",
}

# Defaults of the HF vision config classes, for fields `save_pretrained` leaves out.
_SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, image_size=224, patch_size=16)  # fmt: skip
_IDEFICS3_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=3072, num_hidden_layers=12,
                                 num_attention_heads=16, image_size=224, patch_size=32)  # fmt: skip
# Gemma 3's SigLIP at 896 px (what its configs write out in full anyway).
_GEMMA3_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                               num_attention_heads=16, image_size=896, patch_size=14)  # fmt: skip
# LlavaOnevisionConfig's vision sub-config when config.json has none at all.
_LLAVA_OV_VISION_DEFAULTS = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
                                 num_attention_heads=16, image_size=384, patch_size=14)  # fmt: skip

# Candidate key prefixes, the one this transformers version writes first.
_PREFIXES: dict[str, list[str]] = {
    "llava_tower": [
        "vision_tower.",
        "vision_tower.vision_model.",
        "model.vision_tower.",
        "model.vision_tower.vision_model.",
    ],
    "llava_projector": ["multi_modal_projector.", "model.multi_modal_projector."],
    "llava_newline": ["image_newline", "model.image_newline"],
    "idefics3_tower": ["model.vision_model.", "vision_model."],
    "idefics3_connector": ["model.connector.", "connector."],
    "gemma3_tower": [
        "model.vision_tower.vision_model.",
        "vision_tower.vision_model.",
        "model.vision_tower.",
        "vision_tower.",
    ],
    "gemma3_projector": ["model.multi_modal_projector.", "multi_modal_projector."],
}


@dataclass(frozen=True)
class VisionInput:
    """One image's tiles exactly as the HF image processor produced them (normalised,
    padding tiles removed), plus what the family needs to lay out its tokens."""

    pixel_values: torch.Tensor  # [num_tiles, 3, H, W]
    image_size: tuple[int, int] | None = None  # original (height, width); LLaVA-OV only


@dataclass(frozen=True)
class VisionConfig:
    """What the vision side of a checkpoint needs, read from its full `config.json`."""

    family: Family
    tower: SiglipConfig
    text_hidden_size: int
    # LLaVA-OneVision only
    feature_layers: tuple[int, ...] = (-1,)
    select_strategy: Literal["full", "default"] = "full"
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    max_num_patches: int = 9
    projector_act: str = "gelu"
    projector_bias: bool = True
    # Idefics3 only
    scale_factor: int = 2
    # Gemma 3 only
    tokens_per_image: int = 256

    def __post_init__(self) -> None:
        if self.select_strategy not in ("full", "default"):
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r} unknown")
        if self.family == "idefics3" and self.tower.patches_per_side % self.scale_factor:
            raise ValueError(
                f"scale_factor {self.scale_factor} does not divide the "
                f"{self.tower.patches_per_side}-patch side of a tile"
            )

    @classmethod
    def from_hf(cls, config: Mapping) -> VisionConfig:
        architectures = config.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
        if family is None:
            raise CheckpointError(
                f"unsupported architecture {architectures} for the vision encoder "
                f"(supported: {sorted(ARCHITECTURES)})"
            )
        text_hidden_size = (config.get("text_config") or {}).get("hidden_size", 4096)
        vision = config.get("vision_config")
        if family == "gemma3":
            tower = SiglipConfig.from_hf(vision or {}, _GEMMA3_VISION_DEFAULTS)
            tokens = int(config.get("mm_tokens_per_image", 256))
            return cls(family, tower, text_hidden_size, tokens_per_image=tokens)
        if family == "idefics3":
            tower = SiglipConfig.from_hf(vision or {}, _IDEFICS3_VISION_DEFAULTS)
            return cls(family, tower, text_hidden_size, scale_factor=config.get("scale_factor", 2))
        defaults = _SIGLIP_DEFAULTS if vision is not None else _LLAVA_OV_VISION_DEFAULTS
        tower = SiglipConfig.from_hf(vision or {}, defaults)
        layers = config.get("vision_feature_layer", -1)
        pinpoints = config.get("image_grid_pinpoints") or [
            [384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)
        ]
        return cls(
            family,
            tower,
            text_hidden_size,
            feature_layers=(layers,) if isinstance(layers, int) else tuple(layers),
            select_strategy=config.get("vision_feature_select_strategy", "full"),
            grid_pinpoints=tuple((int(h), int(w)) for h, w in pinpoints),
            max_num_patches=max_patches_from_aspect_ratio(
                config.get("vision_aspect_ratio", "anyres_max_9")
            ),
            projector_act=config.get("projector_hidden_act", "gelu"),
            projector_bias=config.get("multimodal_projector_bias", True),
        )


def _find_prefix(tensors: Mapping[str, torch.Tensor], kind: str, probe: str) -> str:
    candidates = _PREFIXES[kind]
    for prefix in candidates:
        if prefix + probe in tensors:
            return prefix
    tried = ", ".join(repr(p + probe) for p in candidates)
    raise CheckpointError(f"missing weight {candidates[0] + probe!r} (looked for {tried})")


class VisionEncoder(torch.nn.Module):
    """SigLIP tower + connector: per-image tiles in, per-image decoder-space tokens out,
    in the order of the image's placeholder tokens in the prompt."""

    def __init__(
        self,
        config: VisionConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        tower_cfg = config.tower
        post_norm = config.family in ("idefics3", "gemma3")
        self.tower = SiglipTower(tower_cfg, post_norm=post_norm, dtype=dtype, device=device)
        if config.family == "llava_onevision":
            vision_dim = tower_cfg.hidden_size * len(config.feature_layers)
            self.projector = LlavaOnevisionProjector(
                vision_dim, config.text_hidden_size, config.projector_act,
                config.projector_bias, dtype=dtype, device=device,
            )  # fmt: skip
            self.image_newline = torch.nn.Parameter(
                torch.empty(config.text_hidden_size, dtype=dtype, device=device)
            )
        elif config.family == "gemma3":
            self.connector = Gemma3Projector(
                tower_cfg.hidden_size, config.text_hidden_size, tower_cfg.patches_per_side,
                config.tokens_per_image, tower_cfg.layer_norm_eps, dtype=dtype, device=device,
            )  # fmt: skip
        else:
            self.connector = Idefics3Connector(
                tower_cfg.hidden_size, config.text_hidden_size, config.scale_factor,
                dtype=dtype, device=device,
            )  # fmt: skip

    @classmethod
    def from_checkpoint(
        cls,
        config: dict,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> VisionEncoder:
        """Build from a checkpoint's full `config.json` and all its tensors (names on disk)."""
        encoder = cls(VisionConfig.from_hf(config), dtype=dtype, device=device)
        encoder.load_weights(tensors)
        return encoder.eval()

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        probe = "embeddings.patch_embedding.weight"
        if self.config.family == "gemma3":
            load_siglip_tower(self.tower, tensors, _find_prefix(tensors, "gemma3_tower", probe))
            prefix = _find_prefix(tensors, "gemma3_projector", "mm_input_projection_weight")
            names = {"norm_weight": prefix + "mm_soft_emb_norm.weight",
                     "projection": prefix + "mm_input_projection_weight"}  # fmt: skip
            load_into(self.connector, tensors, names)
            return
        if self.config.family == "idefics3":
            prefix = _find_prefix(tensors, "idefics3_tower", probe)
            position_ids = idefics3_position_ids(self.config.tower.patches_per_side)
            load_siglip_tower(self.tower, tensors, prefix, position_ids)
            prefix = _find_prefix(tensors, "idefics3_connector", "modality_projection.proj.weight")
            load_into(
                self.connector, tensors, {"proj.weight": prefix + "modality_projection.proj.weight"}
            )
            return
        load_siglip_tower(self.tower, tensors, _find_prefix(tensors, "llava_tower", probe))
        prefix = _find_prefix(tensors, "llava_projector", "linear_1.weight")
        names = {name: prefix + name for name, _ in self.projector.named_parameters()}
        load_into(self.projector, tensors, names)
        newline_name = _find_prefix(tensors, "llava_newline", "")
        with torch.no_grad():
            self.image_newline.copy_(take(tensors, newline_name, tuple(self.image_newline.shape)))

    def pack_weights(self) -> int:
        """Prepack the CPU float32 linears of the tower and the connector (oneDNN layout,
        fused epilogues); returns how many. The embeddings stay float32 results."""
        connector = self.projector if self.config.family == "llava_onevision" else self.connector
        return self.tower.pack() + pack_linears(connector)

    def num_image_tokens(self, image: VisionInput) -> int:
        """Placeholder tokens `image` takes in the prompt (= rows of its `encode` output),
        computed without running the tower."""
        self._check(image)
        num_tiles = image.pixel_values.shape[0]
        if self.config.family == "gemma3":
            return num_tiles * self.config.tokens_per_image
        if self.config.family == "idefics3":
            return num_tiles * (self.config.tower.patches_per_side // self.config.scale_factor) ** 2
        num_patches = self.config.tower.patches_per_side**2
        if self.config.select_strategy == "default":
            num_patches -= 1
        return anyres_num_tokens(
            num_tiles, num_patches, image.image_size, self.config.grid_pinpoints,
            self.config.tower.image_size, self.config.max_num_patches,
        )  # fmt: skip

    def _check(self, image: VisionInput) -> None:
        size = self.config.tower.image_size
        shape = tuple(image.pixel_values.shape)
        if len(shape) != 4 or shape[1:] != (self.config.tower.num_channels, size, size):
            raise ValueError(
                f"pixel_values of shape {shape}, expected [num_tiles, "
                f"{self.config.tower.num_channels}, {size}, {size}]"
            )
        if shape[0] == 0:
            raise ValueError("an image with no tiles")
        if self.config.family == "llava_onevision":
            if image.image_size is None:
                raise ValueError("LLaVA-OneVision needs the original image_size (height, width)")
            if shape[0] > 1:
                rows, cols = anyres_grid_shape(image.image_size, self.config.grid_pinpoints, size)
                if shape[0] != 1 + rows * cols:
                    raise ValueError(
                        f"image of size {tuple(image.image_size)} needs 1 + {rows}x{cols} tiles "
                        f"(or 1 in a multi-image prompt), got {shape[0]}"
                    )

    def tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_tiles, 3, H, W] -> [num_tiles, tokens_per_tile, text_hidden]"""
        if self.config.family in ("idefics3", "gemma3"):
            return self.connector(self.tower(pixel_values))
        states = self.tower.hidden_states(pixel_values, self.config.feature_layers)
        features = torch.cat(states, dim=-1)  # [T, P, D * num_layers]
        if self.config.select_strategy == "default":
            features = features[:, 1:]  # drops a patch: SigLIP has no class token
        return self.projector(features)

    @torch.no_grad()
    def encode(
        self,
        images: list[VisionInput],
        tile_features: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Per image: [num_image_tokens, text_hidden], in prompt placeholder order.
        `tile_features`: runs the tower + projection over the step's tiles in place of
        `self.tile_features` (tensor parallelism spreads the tiles over the ranks)."""
        if not images:
            return []
        for image in images:
            self._check(image)
        param = self.tower.vit.pos_embed
        # [total_tiles, 3, H, W]: one batched tower call over all tiles of all images
        pixel_values = torch.cat([image.pixel_values for image in images])
        features = (tile_features or self.tile_features)(pixel_values.to(param.device, param.dtype))
        per_image = features.split([image.pixel_values.shape[0] for image in images])
        if self.config.family in ("idefics3", "gemma3"):  # tiles' tokens back to back
            return [tiles.reshape(-1, tiles.shape[-1]) for tiles in per_image]
        return [
            pack_anyres(
                tiles,
                image.image_size,
                self.config.grid_pinpoints,
                self.config.tower.image_size,
                self.config.max_num_patches,
                self.image_newline,
            )  # fmt: skip
            for tiles, image in zip(per_image, images, strict=True)
        ]


def _is_blank(tiles: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] -> [N] bool: tiles that are entirely 0.0 (batch padding)."""
    return (tiles == 0.0).flatten(1).all(dim=1)


def _llava_inputs_from_hf(outputs: Mapping) -> list[VisionInput]:
    pixel_values = outputs["pixel_values"]  # [num_images, max_tiles, 3, H, W] or a list
    image_sizes = [tuple(int(v) for v in size) for size in outputs["image_sizes"]]
    batch_num_images = outputs.get("batch_num_images")
    if batch_num_images is None:
        need_patching = [True] * len(image_sizes)
    else:
        need_patching = [int(n) == 1 for n in batch_num_images for _ in range(int(n))]
    inputs = []
    for tiles, size, patched in zip(pixel_values, image_sizes, need_patching, strict=True):
        tiles = torch.as_tensor(tiles)
        if patched:  # drop the trailing all-zero tiles that pad the batch
            blank = _is_blank(tiles).tolist()
            num_tiles = len(blank)
            while num_tiles > 1 and blank[num_tiles - 1]:
                num_tiles -= 1
        else:  # multi-image prompts: only the base tile, whatever the size
            num_tiles = 1
        inputs.append(VisionInput(tiles[:num_tiles], image_size=size))
    return inputs


def _idefics3_inputs_from_hf(outputs: Mapping) -> list[VisionInput]:
    pixel_values = outputs["pixel_values"]  # [batch, max_tiles, 3, H, W]
    masks = outputs.get("pixel_attention_mask")  # [batch, max_tiles, H, W]
    rows, cols = outputs.get("rows"), outputs.get("cols")
    inputs = []
    for sample, sample_tiles in enumerate(pixel_values):
        sample_tiles = torch.as_tensor(sample_tiles)
        real = ~_is_blank(sample_tiles)  # the model drops all-0.0 tiles, so do we
        tiles = sample_tiles[real]
        if masks is not None and not bool(torch.as_tensor(masks[sample])[real].all()):
            raise ValueError(
                "partly padded Idefics3 tiles (pixel_attention_mask not all ones) are not "
                "supported: every tile must be a full image_size square"
            )
        if rows is None or cols is None:
            counts = [tiles.shape[0]]  # one image per prompt
        else:
            counts = [
                r * c + 1 if r * c else 1 for r, c in zip(rows[sample], cols[sample], strict=True)
            ]
        if sum(counts) != tiles.shape[0]:
            raise ValueError(
                f"sample {sample}: rows/cols give {sum(counts)} tiles, pixel_values hold "
                f"{tiles.shape[0]} non-blank tiles"
            )
        inputs += [VisionInput(part) for part in tiles.split(counts)]
    return inputs


def vision_inputs_from_hf(family: Family, processor_outputs: Mapping) -> list[VisionInput]:
    """HF processor (or image processor) output for a batch -> one VisionInput per image,
    in order.

    LLaVA-OneVision: uses `pixel_values`, `image_sizes` and, if present, `batch_num_images`
    (images of multi-image prompts get their base tile only, as in transformers).
    Idefics3 / SmolVLM: uses `pixel_values` and `pixel_attention_mask`; with several images
    in one prompt it needs the image processor's `rows` / `cols`
    (`image_processor(images, return_row_col_info=True)`), otherwise each prompt's tiles are
    taken as one image.
    """
    if family == "llava_onevision":
        return _llava_inputs_from_hf(processor_outputs)
    if family == "idefics3":
        return _idefics3_inputs_from_hf(processor_outputs)
    if family == "gemma3":  # `num_crops`: per image, its pan-and-scan crops after it
        pixel_values = torch.as_tensor(processor_outputs["pixel_values"])
        counts = [1 + int(n) for n in processor_outputs["num_crops"]]
        return [VisionInput(tiles) for tiles in pixel_values.split(counts)]
    raise ValueError(
        f"unknown vision family {family!r} (expected one of {list(ARCHITECTURES.values())})"
    )

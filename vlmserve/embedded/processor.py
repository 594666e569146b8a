"""Prompt + image processor of the embedded model (chat template, tiling, normalisation).

An image in a user message becomes `<img_start>`, then `tokens_per_tile` `<image>` tokens for
each of its tiles (InternVL dynamic tiling, row-major, the global thumbnail last), then
`<img_end>`. The pixel values of an image are its tiles, [num_tiles, 3, S, S], float32,
normalised with mean/std 0.5 (a real tile never becomes all zeros, which Idefics3 would
drop as padding).

Feeding transformers' Idefics3ForConditionalGeneration:

    encoded = processor.encode(messages, images=[image])
    input_ids = torch.tensor([encoded.token_ids])
    pixel_values = torch.cat(encoded.pixel_values)[None]   # [1, num_tiles_total, 3, S, S]
    out = model.generate(input_ids=input_ids, pixel_values=pixel_values, max_new_tokens=32)
    processor.decode(out[0, input_ids.shape[1]:])
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

from encoders.image_spec import ImageSpec
from encoders.tiling.grid import internvl_grid, internvl_tile_boxes
from vlmserve.embedded.tokenizer import (
    IMAGE_END_TOKEN,
    IMAGE_START_TOKEN,
    IMAGE_TOKEN,
    build_tokenizer,
)

PREPROCESSOR_CONFIG = "preprocessor_config.json"
Message = dict[str, Any]


@dataclass(frozen=True)
class ImageConfig:
    """Tiling and normalisation of the embedded model (saved as preprocessor_config.json)."""

    image_size: int = 48  # tile side in pixels
    patch_size: int = 8
    scale_factor: int = 2  # pixel shuffle: scale_factor**2 patches -> one visual token
    min_num_tiles: int = 1
    max_num_tiles: int = 12
    use_thumbnail: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError(
                f"image_size={self.image_size} must be a multiple of patch_size="
                f"{self.patch_size} * scale_factor={self.scale_factor}"
            )
        if not 1 <= self.min_num_tiles <= self.max_num_tiles:
            raise ValueError(f"bad tile range {self.min_num_tiles}..{self.max_num_tiles}")

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch_size // self.scale_factor) ** 2

    def image_spec(self, jpeg_draft: bool = False) -> ImageSpec:
        """These settings as the serving pipeline's ImageSpec (layout from the header,
        uint8 tiles from the pool, normalisation on the device): the same tiles and
        pixel values as `SceneProcessor.pixel_values`."""
        return ImageSpec(
            "internvl", tile_size=self.image_size, resample=int(Image.Resampling.BICUBIC),
            image_mean=self.image_mean, image_std=self.image_std, rescale_factor=1 / 255,
            tokens_per_tile=self.tokens_per_tile, min_num_tiles=self.min_num_tiles,
            max_num_tiles=self.max_num_tiles, use_thumbnail=self.use_thumbnail,
            jpeg_draft=jpeg_draft,
        )  # fmt: skip


class EncodedPrompt(NamedTuple):
    token_ids: list[int]
    pixel_values: list[torch.Tensor]  # one [num_tiles, 3, S, S] tensor per image, in order


class SceneProcessor:
    """Chat template + tokenizer + tiling for the embedded default model."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, image_config: ImageConfig) -> None:
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.image_token_id: int = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.eos_token_id: int = tokenizer.eos_token_id
        self.pad_token_id: int = tokenizer.pad_token_id

    @classmethod
    def build(cls, image_config: ImageConfig | None = None) -> SceneProcessor:
        """A fresh processor (used by training, before any checkpoint exists)."""
        return cls(build_tokenizer(), image_config or ImageConfig())

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> SceneProcessor:
        folder = Path(folder)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        raw = json.loads((folder / PREPROCESSOR_CONFIG).read_text())
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        fields = {k: v for k, v in fields.items() if k in ImageConfig.__dataclass_fields__}
        return cls(tokenizer, ImageConfig(**fields))

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.tokenizer.save_pretrained(folder)
        config = {**asdict(self.image_config), "tokens_per_tile": self.image_config.tokens_per_tile}
        config["processor_class"] = type(self).__name__
        (folder / PREPROCESSOR_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    # -- sizes -------------------------------------------------------------------------------

    def grid(self, width: int, height: int) -> tuple[int, int]:
        c = self.image_config
        return internvl_grid(
            width, height, image_size=c.image_size, min_num=c.min_num_tiles, max_num=c.max_num_tiles
        )

    def num_tiles(self, width: int, height: int) -> int:
        cols, rows = self.grid(width, height)
        extra = 1 if self.image_config.use_thumbnail and cols * rows > 1 else 0
        return cols * rows + extra

    def num_image_tokens(self, width: int, height: int) -> int:
        """Visual tokens of a width × height image, from its size alone (no <img_*> markers)."""
        return self.num_tiles(width, height) * self.image_config.tokens_per_tile

    # -- images ------------------------------------------------------------------------------

    def tile_images(self, image: Image.Image) -> list[Image.Image]:
        """The image's tiles as PIL images (row-major, thumbnail last when > 1 tile)."""
        c = self.image_config
        image = image.convert("RGB")
        grid = self.grid(*image.size)
        resized = image.resize(
            (grid[0] * c.image_size, grid[1] * c.image_size), Image.Resampling.BICUBIC
        )
        tiles = [resized.crop(box) for box in internvl_tile_boxes(grid, image_size=c.image_size)]
        if c.use_thumbnail and len(tiles) > 1:
            tiles.append(image.resize((c.image_size, c.image_size), Image.Resampling.BICUBIC))
        return tiles

    def pixel_values(self, image: Image.Image) -> torch.Tensor:
        """[num_tiles, 3, S, S] float32, normalised."""
        c = self.image_config
        tiles = np.stack([np.asarray(tile, dtype=np.float32) for tile in self.tile_images(image)])
        mean = np.asarray(c.image_mean, dtype=np.float32) * 255.0
        std = np.asarray(c.image_std, dtype=np.float32) * 255.0
        return torch.from_numpy((tiles - mean) / std).permute(0, 3, 1, 2).contiguous()

    # -- text --------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text, with one `<image>` per image (not yet expanded to its tiles)."""
        text = self.tokenizer.apply_chat_template(
            [_strip_images(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        assert isinstance(text, str)
        return text

    def encode(
        self,
        messages: Sequence[Message],
        images: Sequence[Image.Image] = (),
        *,
        add_generation_prompt: bool = True,
    ) -> EncodedPrompt:
        """Token ids + per-image pixel values of an OpenAI-style conversation.

        An image part is `{"type": "image"}` (its PIL image taken from `images`, in order) or
        `{"type": "image", "image": <PIL image>}` (inline). Text parts are
        `{"type": "text", "text": ...}`; a plain string content is one text part.
        """
        pil_images = _collect_images(messages, images)
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        _check_image_count(text, len(pil_images))
        pixel_values = [self.pixel_values(image) for image in pil_images]
        token_ids = self.expand_ids(text, [tiles.shape[0] for tiles in pixel_values])
        return EncodedPrompt(token_ids, pixel_values)

    def expand_ids(self, text: str, num_tiles: Sequence[int]) -> list[int]:
        """Token ids of a templated prompt whose i-th `<image>` becomes an image of
        `num_tiles[i]` tiles (the serving path knows the counts from the headers)."""
        segments = _check_image_count(text, len(num_tiles))
        token_ids = self._text_ids(segments[0])
        for count, segment in zip(num_tiles, segments[1:], strict=True):
            token_ids += self.image_prompt_ids(count) + self._text_ids(segment)
        return token_ids

    def image_prompt_ids(self, num_tiles: int) -> list[int]:
        start, end = self.tokenizer.convert_tokens_to_ids([IMAGE_START_TOKEN, IMAGE_END_TOKEN])
        return (
            [start]
            + [self.image_token_id] * (num_tiles * self.image_config.tokens_per_tile)
            + [end]
        )

    def decode(self, token_ids: Sequence[int] | torch.Tensor) -> str:
        """Text of generated ids, up to the first end token, without special tokens."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def _text_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _check_image_count(text: str, num_images: int) -> list[str]:
    """The prompt's text segments around its `<image>` markers, one marker per image."""
    segments = text.split(IMAGE_TOKEN)
    if len(segments) - 1 != num_images:
        raise ValueError(f"{len(segments) - 1} image parts but {num_images} images")
    return segments


def _strip_images(message: Message) -> Message:
    content = message["content"]
    if isinstance(content, str):
        return message
    parts = [{"type": "image"} if p["type"] == "image" else p for p in content]
    return {**message, "content": parts}


def _collect_images(
    messages: Sequence[Message], images: Sequence[Image.Image]
) -> list[Image.Image]:
    queue = list(images)
    found: list[Image.Image] = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            continue
        for part in content:
            if part["type"] != "image":
                continue
            if part.get("image") is not None:
                found.append(part["image"])
            elif queue:
                found.append(queue.pop(0))
            else:
                raise ValueError("an image part has no image: pass it in `images` or inline")
    if queue:
        raise ValueError(f"{len(queue)} images passed but not referenced by an image part")
    return found

"""Prompts for the embedded default model: its SceneProcessor (chat template, InternVL
tiling, normalisation) behind the engine's processor interface."""

from __future__ import annotations

from encoders.config import EncoderConfig
from encoders.images import load_image
from encoders.pixel_budget import shared_budget
from encoders.vision import VisionInput
from vlmserve.embedded.processor import SceneProcessor
from vlmserve.models.loader import LoadedModel
from vlmserve.processing import (
    PerThread,
    ProcessedPrompt,
    Request,
    check_image_count,
    place_images,
    prompt_from_ids,
    split_messages,
)


class ScenePromptProcessor:
    def __init__(
        self, path: str, model: LoadedModel, max_images: int, encoder: EncoderConfig | None = None
    ) -> None:
        self.scene = SceneProcessor.from_pretrained(path)
        self.encoder = encoder or EncoderConfig()
        self.tokenizer = self.scene.tokenizer
        self.model = model
        self.max_images = max_images
        self._scene = PerThread(self.scene)  # process() runs on several threads at once

    def pool_metrics(self) -> dict[str, float]:
        return {}  # tiles are made inline by SceneProcessor

    def process(self, request: Request) -> ProcessedPrompt:
        if request.prompt_token_ids is not None:
            return prompt_from_ids(request, self.model.decoder.cfg.vocab_size)
        if request.messages is None:
            if request.prompt is None:
                raise ValueError("a request needs messages or a prompt")
            if request.images:
                raise ValueError("the embedded model takes images in chat messages only")
            tokenizer = self._scene.get().tokenizer
            ids = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
            return ProcessedPrompt(list(ids), [])
        templated, sources = split_messages(request.messages)
        check_image_count(len(sources), self.max_images)
        # Decoded inline (not on the pool yet), under the process's pixel budget.
        budget = shared_budget(self.encoder.resolved_max_decode_pixels)
        loaded = [load_image(s, self.encoder.max_pixels, budget) for s in sources]
        scene = self._scene.get()
        encoded = scene.encode(templated, images=[image for image, _ in loaded])
        per_tile = scene.image_config.tokens_per_tile
        images = [
            (digest, tiles.shape[0] * per_tile, VisionInput(tiles))
            for (_, digest), tiles in zip(loaded, encoded.pixel_values, strict=True)
        ]
        placeholders = place_images(encoded.token_ids, scene.image_token_id, images)
        for placeholder, tiles in zip(placeholders, encoded.pixel_values, strict=True):
            placeholder.num_tiles = tiles.shape[0]  # [num_tiles, 3, S, S]
        return ProcessedPrompt(encoded.token_ids, placeholders)

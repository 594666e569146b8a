"""Prompts for the embedded default model: its SceneProcessor (chat template, InternVL
tiling, normalisation) behind the engine's processor interface."""

from __future__ import annotations

import threading

from encoders.images import load_image
from encoders.vision import VisionInput
from scheduler.sequence import ImagePlaceholder
from vlmserve.embedded.processor import SceneProcessor
from vlmserve.models.loader import LoadedModel
from vlmserve.processing import (
    ProcessedPrompt,
    Request,
    check_image_count,
    prompt_from_ids,
    split_messages,
)


class ScenePromptProcessor:
    def __init__(self, path: str, model: LoadedModel, max_images: int) -> None:
        self.scene = SceneProcessor.from_pretrained(path)
        self.tokenizer = self.scene.tokenizer
        self.model = model
        self.max_images = max_images
        self._lock = threading.Lock()  # process() may run on several threads

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
            with self._lock:
                ids = self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
            return ProcessedPrompt(list(ids), [])
        templated, sources = split_messages(request.messages)
        check_image_count(len(sources), self.max_images)
        loaded = [load_image(source) for source in sources]
        with self._lock:
            encoded = self.scene.encode(templated, images=[image for image, _ in loaded])
        image_token = self.scene.image_token_id
        positions = [i for i, t in enumerate(encoded.token_ids) if t == image_token]
        placeholders, cursor = [], 0
        per_tile = self.scene.image_config.tokens_per_tile
        for (_, digest), tiles in zip(loaded, encoded.pixel_values, strict=True):
            count = tiles.shape[0] * per_tile
            vision_input = VisionInput(tiles)
            placeholders.append(
                ImagePlaceholder(digest, positions[cursor : cursor + count], vision_input)
            )
            cursor += count
        assert cursor == len(positions), "placeholder count differs from the images' tiles"
        return ProcessedPrompt(encoded.token_ids, placeholders)

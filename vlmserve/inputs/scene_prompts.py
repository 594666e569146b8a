"""Prompts for the embedded default model: its chat template and `<img_start>` /
`<img_end>` markers, its images through the same path as every other model.

An image's layout and exact token count come from its header (`ImageSpec` "internvl",
built from the checkpoint's preprocessor_config.json); its tiles from the preprocessing
pool (inline with 0 workers); its embeddings from the encoder cache when the same bytes
came before. The token ids are what `SceneProcessor.encode` gives for the same images.
`use_pool=False` (`--hf-image-processor`) keeps SceneProcessor's own PIL tiling, the
reference path.
"""

from __future__ import annotations

import time

from encoders.cache import EncoderCache
from encoders.config import EncoderConfig
from encoders.images import ImageSource, load_image
from encoders.pixel_budget import shared_budget
from encoders.stage import pool_metrics, submit_images, warm_pool
from encoders.vision import VisionInput
from vlmserve.embedded.processor import SceneProcessor
from vlmserve.inputs.processing import (
    ProcessedPrompt,
    Request,
    check_image_count,
    place_images,
    place_works,
    prompt_from_ids,
    split_messages,
)
from vlmserve.inputs.shared_tokenizer import CopyPool
from vlmserve.worker.models.loader import LoadedModel


class ScenePromptProcessor:
    """The engine's prompt processor for a checkpoint whose processor is SceneProcessor."""

    def __init__(
        self,
        path: str,
        model: LoadedModel,
        max_images: int,
        encoder: EncoderConfig | None = None,
        encoder_cache: EncoderCache | None = None,
    ) -> None:
        self.scene = SceneProcessor.from_pretrained(path)
        self.encoder = encoder or EncoderConfig()
        self.encoder_cache = encoder_cache
        self.tokenizer = self.scene.tokenizer
        self.model = model
        self.max_images = max_images
        self.image_spec = (
            self.scene.image_config.image_spec(self.encoder.jpeg_draft)
            if self.encoder.use_pool
            else None
        )
        self._scenes = CopyPool(self.scene)  # process() runs on several threads at once
        if self.image_spec is not None:
            warm_pool(self.encoder)

    def warm(self) -> dict[str, float]:
        """Make the copies `process` borrows now (the warm-up): their seconds."""
        start = time.perf_counter()
        self._scenes.fill()
        return {f"processor copies x{self._scenes.size}": time.perf_counter() - start}

    def pool_metrics(self) -> dict[str, float]:
        return {} if self.image_spec is None else pool_metrics(self.encoder)

    def process(self, request: Request) -> ProcessedPrompt:
        if request.prompt_token_ids is not None:
            return prompt_from_ids(request, self.model.decoder.cfg.vocab_size)
        if request.messages is None:
            if request.prompt is None:
                raise ValueError("a request needs messages or a prompt")
            if request.images:
                raise ValueError("the embedded model takes images in chat messages only")
            with self._scenes.borrow() as scene:
                ids = scene.tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
            return ProcessedPrompt(list(ids), [])
        templated, sources = split_messages(request.messages)
        check_image_count(len(sources), self.max_images)
        if self.image_spec is None:
            return self._with_scene_processor(templated, sources)
        with self._scenes.borrow() as scene:
            text = scene.apply_chat_template(templated)
            # Queued on the header's layout while the pool decodes (as HFPromptProcessor).
            works = submit_images(sources, self.image_spec, self.encoder, self.encoder_cache)
            token_ids = scene.expand_ids(text, [work.layout.num_tiles for work in works])
        placed = place_works(token_ids, self.scene.image_token_id, works)
        return ProcessedPrompt(token_ids, placed, works)

    def _with_scene_processor(
        self, templated: list[dict], sources: list[ImageSource]
    ) -> ProcessedPrompt:
        """SceneProcessor's own decode, tiling and normalisation (no pool, no cache)."""
        budget = shared_budget(self.encoder.resolved_max_decode_pixels)
        loaded = [load_image(s, self.encoder.max_pixels, budget) for s in sources]
        with self._scenes.borrow() as scene:
            encoded = scene.encode(templated, images=[image for image, _ in loaded])
        per_tile = self.scene.image_config.tokens_per_tile
        inputs = [VisionInput(tiles) for tiles in encoded.pixel_values]
        images = [
            (digest, tiles.shape[0] * per_tile)
            for (_, digest), tiles in zip(loaded, encoded.pixel_values, strict=True)
        ]
        placeholders = place_images(encoded.token_ids, self.scene.image_token_id, images)
        for placeholder, tiles in zip(placeholders, encoded.pixel_values, strict=True):
            placeholder.num_tiles = tiles.shape[0]  # [num_tiles, 3, S, S]
        return ProcessedPrompt(encoded.token_ids, placeholders, inputs)

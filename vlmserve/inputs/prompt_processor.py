"""The prompt processor a checkpoint asks for: the embedded model's (vlmserve/inputs/
scene_prompts.py) or the HF processor's (vlmserve/inputs/processing.py)."""

from __future__ import annotations

import json
from pathlib import Path

from encoders.cache import EncoderCache
from encoders.config import EncoderConfig
from vlmserve.inputs.processing import HFPromptProcessor
from vlmserve.inputs.scene_prompts import ScenePromptProcessor
from vlmserve.worker.models.loader import LoadedModel


def make_prompt_processor(
    path: str,
    model: LoadedModel,
    max_images: int,
    encoder: EncoderConfig | None = None,
    encoder_cache: EncoderCache | None = None,
):
    """The processor a checkpoint folder asks for: the embedded model's own (its
    preprocessor_config.json names `SceneProcessor`) or the HF processor."""
    config_path = Path(path) / "preprocessor_config.json"
    if config_path.is_file():
        if json.loads(config_path.read_text()).get("processor_class") == "SceneProcessor":
            return ScenePromptProcessor(path, model, max_images, encoder, encoder_cache)
    return HFPromptProcessor(path, model, max_images, encoder, encoder_cache)

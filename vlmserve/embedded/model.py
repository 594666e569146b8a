"""Shape of the embedded default model: transformers' Idefics3 at a tiny size.

SigLIP-style ViT (patch 8 over 48-px tiles: 6×6 patches) -> pixel shuffle with scale factor 2
(4:1, each visual token covers one 16-px cell of the scene grid) + linear projection ->
Llama decoder with grouped-query attention. Stored with `save_pretrained`, so transformers
loads it as the correctness reference and the engine loads it through its Idefics3 family.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

from vlmserve.embedded.processor import SceneProcessor


@dataclass(frozen=True)
class TinyVLMConfig:
    """Layer sizes of the embedded model (tile geometry comes from the processor)."""

    vision_hidden_size: int = 192
    vision_num_layers: int = 4
    vision_num_heads: int = 6
    vision_intermediate_size: int = 768
    text_hidden_size: int = 192
    text_num_layers: int = 4
    text_num_heads: int = 6
    text_num_kv_heads: int = 2
    text_intermediate_size: int = 512
    max_position_embeddings: int = 512

    def __post_init__(self) -> None:
        if self.vision_hidden_size % self.vision_num_heads:
            raise ValueError(f"vision_hidden_size={self.vision_hidden_size} % heads != 0")
        if self.text_hidden_size % self.text_num_heads:
            raise ValueError(f"text_hidden_size={self.text_hidden_size} % heads != 0")
        if self.text_num_heads % self.text_num_kv_heads:
            raise ValueError(f"text_num_kv_heads={self.text_num_kv_heads} must divide the heads")


def build_hf_config(config: TinyVLMConfig, processor: SceneProcessor) -> Idefics3Config:
    image = processor.image_config
    tokenizer = processor.tokenizer
    vision = Idefics3VisionConfig(
        hidden_size=config.vision_hidden_size,
        intermediate_size=config.vision_intermediate_size,
        num_hidden_layers=config.vision_num_layers,
        num_attention_heads=config.vision_num_heads,
        image_size=image.image_size,
        patch_size=image.patch_size,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.text_hidden_size,
        intermediate_size=config.text_intermediate_size,
        num_hidden_layers=config.text_num_layers,
        num_attention_heads=config.text_num_heads,
        num_key_value_heads=config.text_num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        pad_token_id=processor.pad_token_id,
        eos_token_id=processor.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=image.scale_factor,
        image_token_id=processor.image_token_id,
        pad_token_id=processor.pad_token_id,
        eos_token_id=processor.eos_token_id,
    )


def build_model(
    config: TinyVLMConfig, processor: SceneProcessor
) -> Idefics3ForConditionalGeneration:
    """A freshly initialised model (seed torch before calling, for reproducible weights)."""
    model = Idefics3ForConditionalGeneration(build_hf_config(config, processor))
    model.generation_config.eos_token_id = processor.eos_token_id
    model.generation_config.pad_token_id = processor.pad_token_id
    model.generation_config.bos_token_id = None
    return model

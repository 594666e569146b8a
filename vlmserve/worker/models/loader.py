"""Load a served model from a local HF checkpoint folder (config.json + *.safetensors), or
a GGUF file's sidecar folder (gguf_checkpoint.py; weights from the file).

Families: LLaVA-OneVision (SigLIP + Qwen2), Idefics3 / SmolVLM (SigLIP + Llama), Gemma 3
(SigLIP + Gemma 3, and its text-only form), and the text-only Llama / Qwen2 decoders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from encoders.weights import CheckpointError, load_tensors, read_config
from kernels.attention import AttentionBackend
from vlmserve.worker.models import quantized
from vlmserve.worker.models.decoder import Decoder, DecoderConfig
from vlmserve.worker.models.gemma3 import gemma3_decoder_config
from vlmserve.worker.models.gguf_checkpoint import weights_file
from vlmserve.worker.models.gguf_weights import read_gguf_tensors
from vlmserve.worker.parallel.sharding import ShardedWeights, TPShard

Family = Literal["llava_onevision", "idefics3", "gemma3", "gemma3_text", "llama", "qwen2"]


@dataclass(frozen=True)
class FamilySpec:
    family: Family
    # Where the decoder's `embed_tokens.weight` lives, newest transformers layout last.
    decoder_prefixes: tuple[str, ...]
    lm_head_names: tuple[str, ...]
    multimodal: bool


_SPECS: dict[str, FamilySpec] = {
    "llava_onevision": FamilySpec(
        "llava_onevision",
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.weight", "lm_head.weight"),
        True,
    ),
    "idefics3": FamilySpec(
        "idefics3", ("model.text_model.",), ("lm_head.weight", "model.lm_head.weight"), True
    ),
    "gemma3": FamilySpec(
        "gemma3",
        ("model.language_model.", "language_model.model."),
        ("lm_head.weight", "language_model.lm_head.weight"),
        True,
    ),
    "gemma3_text": FamilySpec("gemma3_text", ("model.",), ("lm_head.weight",), False),
    "llama": FamilySpec("llama", ("model.",), ("lm_head.weight",), False),
    "qwen2": FamilySpec("qwen2", ("model.",), ("lm_head.weight",), False),
}
_MODEL_TYPES = {"smolvlm": "idefics3"}
# What `vlmserve info` and the refusal name.
SUPPORTED_FAMILIES = (
    "LLaVA-OneVision", "Idefics3/SmolVLM", "Gemma 3 (image-text and text)", "Llama", "Qwen2",
)  # fmt: skip


@dataclass
class LoadedModel:
    family: Family
    config: dict  # the checkpoint's config.json
    text_config: dict
    decoder: Decoder
    vision: torch.nn.Module | None  # encoders.vision.VisionEncoder for multimodal families
    image_token_id: int | None
    # An image's tokens attend to each other in full during prefill (Gemma 3).
    bidirectional_images: bool = False


def family_of(config: dict) -> FamilySpec:
    model_type = _MODEL_TYPES.get(config.get("model_type", ""), config.get("model_type", ""))
    if model_type not in _SPECS:
        archs = config.get("architectures") or []
        raise CheckpointError(
            f"unsupported architecture {archs or model_type!r}: vlmserve serves "
            f"{', '.join(SUPPORTED_FAMILIES)} checkpoints"
        )
    return _SPECS[model_type]


def _pick(tensors: dict, candidates: tuple[str, ...], what: str) -> str:
    for name in candidates:
        if name in tensors:
            return name
    raise CheckpointError(f"missing weight for {what}: none of {list(candidates)} found")


def decoder_config(config: dict) -> DecoderConfig:
    """The decoder's shape from a checkpoint's config.json (no weights read)."""
    spec = family_of(config)
    text_config = config.get("text_config", config) if spec.multimodal else config
    tie = bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))
    if spec.family in ("gemma3", "gemma3_text"):
        tie = bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", True)))
        return gemma3_decoder_config(text_config, tie=tie, causal_lm=spec.family == "gemma3_text")
    return DecoderConfig.from_hf(
        text_config, qkv_bias=text_config.get("model_type") == "qwen2", tie=tie
    )


def head_dim_of(path: str) -> int:
    """The decoder's head dim, read from the checkpoint's config alone (the attention
    backend is chosen before the weights load)."""
    return decoder_config(read_config(path)).head_dim


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    shard: TPShard | None = None,
    weight_format: str = "none",
) -> LoadedModel:
    """`shard`: a tensor-parallel rank's slice of the decoder (its heads and MLP rows);
    the vision tower and the embeddings are whole on every rank. `weight_format`
    (ModelConfig.weight_format): "none" dense in `dtype`; "gguf" a GGUF file's blocks
    run as stored; "int8" / "fp8" quantized at load (models/quantized.py)."""
    config = read_config(path)
    spec = family_of(config)
    text_config = config.get("text_config", config) if spec.multimodal else config
    decoder_cfg = decoder_config(config)
    gguf = weights_file(path)  # a GGUF file's sidecar: weights dequantized from the file
    if weight_format == "gguf" and gguf is None:
        raise CheckpointError(f"{path} is not a GGUF file's folder: its weights have no blocks")
    if weight_format != "none" and shard is not None:
        raise CheckpointError(
            "quantized weights do not run with tensor parallelism yet: --quantization none"
        )
    if gguf:
        tensors = read_gguf_tensors(gguf, text_config, keep_blocks=weight_format == "gguf")
    else:
        tensors = load_tensors(path)
    embed = _pick(tensors, tuple(p + "embed_tokens.weight" for p in spec.decoder_prefixes), "")
    prefix = embed[: -len("embed_tokens.weight")]
    lm_head = next((n for n in spec.lm_head_names if n in tensors), spec.lm_head_names[0])
    decoder_tensors = tensors
    if shard is not None and decoder_cfg.variant == "gemma3":
        raise CheckpointError("tensor parallelism does not serve Gemma 3 yet")
    if shard is not None:
        decoder_tensors = ShardedWeights(tensors, prefix, decoder_cfg, shard)
        decoder_cfg = shard.local_config(decoder_cfg)
    with torch.device("meta"):
        decoder = Decoder(decoder_cfg, backend)
    if weight_format == "gguf":
        quantized.install_blocks(decoder, tensors, prefix, lm_head, dtype)
        decoder_tensors = quantized.DenseView(tensors)
    decoder = quantized.materialize(decoder, dtype)
    decoder.load(decoder_tensors, prefix, lm_head)
    if weight_format == "int8":
        quantized.quantize_int8_decoder(decoder)
    if weight_format in ("gguf", "int8") and device.type == "cpu":
        quantized.calibrate(decoder, dtype)
    decoder = decoder.to(device).eval()
    if weight_format in ("gguf", "int8"):
        quantized.place(decoder, device)  # the blocks and their kernels (Triton on CUDA)
    if weight_format == "fp8":
        quantized.quantize_fp8_decoder(decoder)

    vision, image_token_id = None, None
    if spec.multimodal:
        from encoders.vision import VisionEncoder

        vision = VisionEncoder.from_checkpoint(config, tensors, dtype, device).eval()
        image_token_id = config.get("image_token_id", config.get("image_token_index"))
    bidirectional = spec.family == "gemma3"
    return LoadedModel(
        spec.family, config, text_config, decoder, vision, image_token_id, bidirectional
    )

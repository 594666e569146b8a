"""What the request router needs to know of the replicas' engine: an image's cost in
visual tokens and the size of each replica's encoder cache in those tokens.

A replica reports its `RoutingProfile` once (`EngineReplica.routing_profile`): the image
settings its prompt processor tiles by (`encoders.image_spec.ImageSpec`, the same record
the engine counts an image's tokens with from its header) and its encoder cache's byte
budget over the bytes one visual token takes there (the decoder's hidden size x the
runner's dtype: the cache holds each image's pooled embeddings). The front door then
prices each uploaded image from its header alone (no pixel decoded) exactly as the
engine will, and the router models each replica's encoder cache as an LRU of that many
tokens (`scheduler.routing.policy.RouterConfig.encoder_cache_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encoders.image_io import DEFAULT_MAX_PIXELS, read_header
from encoders.image_spec import ImageSpec
from scheduler.routing.policy import encoder_cache_tokens

__all__ = ["RoutingProfile", "engine_profile"]


@dataclass(frozen=True)
class RoutingProfile:
    """`image_spec`: None where the engine keeps the HF image processor (its counts are
    not reproduced from a header); `encoder_cache_tokens`: None without an encoder cache
    or without a spec."""

    image_spec: ImageSpec | None
    encoder_cache_tokens: int | None
    max_pixels: int = DEFAULT_MAX_PIXELS

    def image_tokens(self, data: bytes) -> int | None:
        """The visual tokens the engine gives the image `data` (as `prepare_images` lays
        out each image of a prompt: `multi_image=False`), or None where they cannot be
        known here: no spec, or bytes the replica will refuse (it answers them itself).
        Never raises: a bad image must not fail the request in the front door."""
        if self.image_spec is None:
            return None
        try:
            header = read_header(data, self.max_pixels)
            return int(self.image_spec.layout(header.width, header.height).num_tokens)
        except Exception:  # noqa: BLE001 - any failure here only loses the image's cost
            return None


def engine_profile(engine: Any) -> RoutingProfile:
    """`engine`'s (a loaded `vlmserve.engine.core.Engine`) profile; a text-only model's
    has neither field, nor has one whose images go through the HF image processor (no
    prices, so no model of the caches: guessed weights would evict the wrong images)."""
    vision = engine.runner.model.vision
    spec = getattr(engine.processor, "image_spec", None)
    if vision is None or spec is None:
        return RoutingProfile(None, None)
    dtype_bytes = engine.runner.dtype.itemsize
    tokens = encoder_cache_tokens(
        engine.runner.encoder_cache.max_bytes, vision.config.text_hidden_size, dtype_bytes
    )
    return RoutingProfile(spec, tokens, engine.config.encoder.max_pixels)

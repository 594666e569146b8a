"""The encoder stage: from request images to pooled embeddings at placeholder positions.

Request side (`prepare_images`, called while a request is tokenised): header-only size ->
layout and exact token count; the encoder cache is peeked and only images it does not
hold go to the preprocessing pool. A hit is pinned (the ImageWork holds the embeddings),
so an eviction between the peek and the step cannot send the image back through decode
and tiling on the engine thread, stalling every decode. Runner side
(`EncoderStage.encode`, once per step): cache hits are reused, the uint8 tiles of every
miss are normalised on the device and run through the SigLIP tower in ONE batched call
(duplicates in a step run once), and the results enter the cache.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from encoders.cache import EncoderCache, encoder_cache_key
from encoders.config import EncoderConfig
from encoders.errors import ImageDecodeError
from encoders.image_io import preprocess_bytes, read_header, tile_image, to_rgb
from encoders.image_spec import ImageLayout, ImageSpec
from encoders.images import ImageSource, content_hash, load_image
from encoders.pixel_budget import PixelBudget, shared_budget
from encoders.preprocess import PreprocessPool, StageTimings, TileResult, shared_pool
from encoders.vision import VisionEncoder, VisionInput

__all__ = [
    "EncoderStage", "ImageWork", "configured_pool", "normalize_tiles", "pool_metrics",
    "prepare_images", "submit_images",
]  # fmt: skip


@dataclass
class ImageWork:
    """One prompt image on its way to the tower (an `ImagePlaceholder.data`)."""

    spec: ImageSpec
    layout: ImageLayout
    cache_key: bytes
    source: bytes | Image.Image  # kept to redo the tiles if the cache evicts it meanwhile
    max_pixels: int
    future: Future | None = None  # None: the cache held it when the request came in
    timings: StageTimings | None = None
    embedding: torch.Tensor | None = None  # pinned cache hit [num_tokens, hidden]
    num_pixels: int = 0  # stored pixels (from the header): what a decode reserves
    budget: PixelBudget | None = None  # bounds decodes made here (the pool has its own)

    @property
    def image_size(self) -> tuple[int, int]:
        return self.layout.height, self.layout.width

    def wait(self) -> None:
        """Block until the tiles exist; raises the image's typed decode error."""
        if self.future is not None:
            self.timings = self.future.result().timings  # read_s went in with the submit

    def tiles(self) -> torch.Tensor:
        """[num_tiles, S, S, 3] uint8, computed here if the pool was skipped."""
        if self.future is None:
            self.future = Future()
            if self.budget is None or isinstance(self.source, Image.Image):
                result = _tile_now(self.source, self.spec, self.layout, self.max_pixels)
            else:
                with self.budget.reserve(self.num_pixels):
                    result = _tile_now(self.source, self.spec, self.layout, self.max_pixels)
            self.future.set_result(result)
        return self.future.result().tiles


def _tile_now(source: bytes | Image.Image, spec: ImageSpec, layout: ImageLayout,
              max_pixels: int) -> TileResult:  # fmt: skip
    from encoders.preprocess_worker import _to_tensor

    start = time.perf_counter()
    if isinstance(source, Image.Image):
        tiles = tile_image(to_rgb(source), spec, layout)
        return TileResult(_to_tensor(tiles), StageTimings(resize_s=time.perf_counter() - start))
    out = preprocess_bytes(source, spec, getattr(layout, "multi_image", False), max_pixels)
    return TileResult(_to_tensor(out.tiles), StageTimings(decode_s=out.decode_s,
                                                          resize_s=out.resize_s))  # fmt: skip


def _read(source: ImageSource) -> bytes | Image.Image:
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (str, Path)):
        try:
            return Path(source).read_bytes()
        except OSError as e:
            raise ImageDecodeError(f"cannot read image file {str(source)!r}: {e}") from e
    return bytes(source)


def prepare_images(
    sources: list[ImageSource],
    spec: ImageSpec,
    *,
    multi_image: bool,
    pool: PreprocessPool | None,
    cache: EncoderCache | None,
    max_pixels: int,
    submit_timeout: float | None = None,
    budget: PixelBudget | None = None,
) -> list[ImageWork]:
    """Layouts and keys now (header only); tiles submitted to `pool` unless cached.
    Raises the typed error of the first bad header (nothing is submitted then).
    `budget` bounds the pixels of decodes made in this process (no pool)."""
    items = []
    for source in sources:
        start = time.perf_counter()
        data = _read(source)
        if isinstance(data, Image.Image):
            image, digest = load_image(data, max_pixels)  # hashes the pixels; decoded already
            width, height = image.size
            data, num_pixels = image, width * height
        else:
            digest = content_hash(data)
            header = read_header(data, max_pixels)
            width, height, num_pixels = header.width, header.height, header.num_pixels
        layout = spec.layout(width, height, multi_image)
        key = encoder_cache_key(digest, spec.key, multi_image)
        timings = StageTimings(read_s=time.perf_counter() - start)
        items.append(ImageWork(spec, layout, key, data, max_pixels, timings=timings,
                               num_pixels=num_pixels, budget=budget))  # fmt: skip
    for work in items:
        if cache is not None and (hit := cache.peek(work.cache_key)) is not None:
            # Pinned: skips decode and tiling even if evicted later. Counted here, where it
            # saves the work: the prefix cache may cover the image so the step never asks.
            work.embedding = hit
            cache.note_hit(work.cache_key)
            continue
        if pool is None or isinstance(work.source, Image.Image):
            work.tiles()  # already decoded (or no pool): tile in this thread
        else:
            work.future = pool.submit(
                work.source, spec, multi_image, max_pixels, timeout=submit_timeout,
                num_pixels=work.num_pixels, read_s=work.timings.read_s,
            )  # fmt: skip
    return items


def configured_pool(config: EncoderConfig) -> PreprocessPool | None:
    """The process's shared pool of `config`'s size; None with 0 workers (inline)."""
    workers = config.resolved_num_workers
    if not workers:
        return None
    return shared_pool(workers, config.max_pending, config.resolved_max_decode_pixels)


def warm_pool(config: EncoderConfig) -> None:
    """Start the shared pool now, on a background thread, so its worker start (the
    forkserver imports the decode stack: seconds on a small loaded machine) overlaps the
    rest of engine start-up instead of the first image request."""
    if config.resolved_num_workers:
        threading.Thread(target=configured_pool, args=(config,), daemon=True).start()


def pool_metrics(config: EncoderConfig) -> dict[str, float]:
    """The pool's counters and per-stage seconds ({} when images are tiled inline)."""
    pool = configured_pool(config)
    return {} if pool is None else pool.metrics()


def submit_images(
    sources: list[ImageSource],
    spec: ImageSpec,
    config: EncoderConfig,
    cache: EncoderCache | None,
    *,
    multi_image: bool = False,
) -> list[ImageWork]:
    """`prepare_images` with `config`'s pool, pixel cap, timeout and decode budget: the
    one image path every model's prompt processor takes."""
    return prepare_images(
        sources, spec, multi_image=multi_image, pool=configured_pool(config), cache=cache,
        max_pixels=config.max_pixels, submit_timeout=config.submit_timeout_s,
        budget=shared_budget(config.resolved_max_decode_pixels),
    )  # fmt: skip


def normalize_tiles(tiles: torch.Tensor, spec: ImageSpec, device: torch.device) -> torch.Tensor:
    """uint8 [T, S, S, 3] -> float32 [T, 3, S, S] on `device`: (x - mean/r) / (std/r),
    the same float32 ops as transformers' fused rescale + normalise."""
    x = tiles.to(device, non_blocking=True).permute(0, 3, 1, 2).to(torch.float32)
    mean = torch.tensor(spec.image_mean, device=device) * (1.0 / spec.rescale_factor)
    std = torch.tensor(spec.image_std, device=device) * (1.0 / spec.rescale_factor)
    return x.sub_(mean[:, None, None]).div_(std[:, None, None])


class EncoderStage:
    """Cache lookups + one batched tower call per step over every missing image."""

    def __init__(self, vision: VisionEncoder, cache: EncoderCache | None, device: torch.device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.vision, self.cache = vision, cache
        self.device, self.dtype = torch.device(device), dtype
        self.num_tower_calls = 0
        self.num_tower_images = 0

    def encode(self, images: list[ImageWork | VisionInput]) -> list[torch.Tensor]:
        """Per image: [num_tokens, hidden] in `dtype`, in placeholder order."""
        out: list[torch.Tensor | None] = [None] * len(images)
        misses: dict[object, list[int]] = {}  # key -> indices (a key runs once per step)
        for i, image in enumerate(images):
            key = image.cache_key if isinstance(image, ImageWork) else ("uncached", i)
            if key in misses:
                misses[key].append(i)
                continue
            if isinstance(image, ImageWork) and image.embedding is not None:
                out[i] = image.embedding
                if self.cache is not None:
                    self.cache.touch(key)  # its hit was counted when it was pinned
                continue
            hit = self.cache.get(key) if self.cache is not None and isinstance(key, bytes) else None
            if hit is not None:
                out[i] = hit
            else:
                misses[key] = [i]
        if misses:
            inputs = [self._vision_input(images[where[0]]) for where in misses.values()]
            embeds = self.vision.encode(inputs)  # one tower call over all tiles
            self.num_tower_calls += 1
            self.num_tower_images += len(inputs)
            for (key, where), emb in zip(misses.items(), embeds, strict=True):
                emb = emb.to(self.dtype)
                if self.cache is not None and isinstance(key, bytes):
                    self.cache.put(key, emb)
                for i in where:
                    out[i] = emb
        return out  # type: ignore[return-value]

    def _vision_input(self, image: ImageWork | VisionInput) -> VisionInput:
        if isinstance(image, VisionInput):
            return image
        pixels = normalize_tiles(image.tiles(), image.spec, self.device)
        return VisionInput(pixels, image_size=image.image_size)

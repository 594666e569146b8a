"""InternVL tiling (the embedded default model) on the serving path: the layout and exact
token count from the header alone, and the pool's uint8 tiles, normalised on the device,
equal to SceneProcessor's own pixel values (float32, exactly)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from encoders.image_io import preprocess_bytes, read_header
from encoders.images import load_image
from encoders.stage import normalize_tiles
from encoders.tiling.internvl import internvl_layout
from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.embedded.processor import ImageConfig, SceneProcessor
from vlmserve.embedded.scenes import generate_scene, render_scene

# (width, height): tiny, around the 48-px tile, exact multiples, 1xN, huge aspect ratios
SIZES = [
    (1, 1), (1, 2), (2, 1), (1, 48), (48, 1), (1, 1000), (1000, 1), (7, 3), (3, 7),
    (23, 24), (24, 23), (47, 48), (48, 48), (49, 48), (48, 49), (96, 48), (48, 96),
    (96, 96), (97, 95), (144, 48), (48, 144), (144, 96), (192, 144), (100, 30), (30, 100),
    (320, 48), (640, 480), (480, 640), (1280, 720), (720, 1280), (1920, 1080), (500, 5000),
    (5000, 500), (8000, 40), (40, 8000), (4000, 3000), (576, 48), (48, 576), (577, 49),
    (123, 457), (457, 123), (999, 1001),
]  # fmt: skip


@pytest.fixture(scope="module")
def scene() -> SceneProcessor:
    return SceneProcessor.from_pretrained(DEFAULT_MODEL_DIR)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _noise(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_sizes_cover_the_range() -> None:
    assert len(set(SIZES)) == len(SIZES) >= 30
    assert (1, 1) in SIZES and max(w / h for w, h in SIZES) >= 200


@pytest.mark.parametrize("use_thumbnail", [True, False])
def test_token_count_from_the_header_equals_scene_processor(scene, use_thumbnail) -> None:
    config = ImageConfig(**{**scene.image_config.__dict__, "use_thumbnail": use_thumbnail})
    reference = SceneProcessor(scene.tokenizer, config)
    spec = config.image_spec()
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    for width, height in SIZES:
        header = read_header(_png(Image.new("RGB", (width, height), (200, 40, 90))))
        layout = spec.layout(header.width, header.height)
        image = Image.new("RGB", (width, height), (200, 40, 90))
        encoded = reference.encode(message, images=[image])
        assert layout.num_tiles == encoded.pixel_values[0].shape[0], (width, height)
        num_image_tokens = encoded.token_ids.count(reference.image_token_id)
        assert layout.num_tokens == num_image_tokens, (width, height)
        text = reference.apply_chat_template(message)
        assert reference.expand_ids(text, [layout.num_tiles]) == encoded.token_ids


def test_layout_fields() -> None:
    layout = internvl_layout(320, 48, tile_size=48, tokens_per_tile=9)
    assert (layout.grid, layout.resized) == ((1, 7), (48, 336))
    assert (layout.num_tiles, layout.num_tokens, layout.has_thumbnail) == (8, 72, True)
    single = internvl_layout(48, 48, tile_size=48, tokens_per_tile=9)
    assert (single.num_tiles, single.num_tokens, single.has_thumbnail) == (1, 9, False)
    with pytest.raises(ValueError, match="image size must be positive"):
        internvl_layout(0, 5, tile_size=48, tokens_per_tile=9)


def _files() -> list[tuple[str, bytes]]:
    """Real PNG and JPEG files: rendered scenes and noise, one tile to a panorama."""
    files = []
    for i, (width, height) in enumerate([(48, 48), (96, 96), (320, 48), (200, 150), (61, 133)]):
        image = render_scene(generate_scene(1000 + i, width=width, height=height))
        for fmt in ("PNG", "JPEG"):
            buf = io.BytesIO()
            image.save(buf, format=fmt, quality=90)
            files.append((f"scene{i}.{fmt}", buf.getvalue()))
    for i, (width, height) in enumerate([(640, 480), (37, 300), (1000, 90)]):
        buf = io.BytesIO()
        _noise(i, width, height).save(buf, format="JPEG" if i % 2 else "PNG", quality=85)
        files.append((f"noise{i}", buf.getvalue()))
    return files


@pytest.mark.parametrize("name,data", _files())
def test_pool_tiles_equal_scene_processor_pixel_values(scene, name, data) -> None:
    spec = scene.image_config.image_spec()
    tiles = torch.from_numpy(preprocess_bytes(data, spec, multi_image=False).tiles)
    ours = normalize_tiles(tiles, spec, torch.device("cpu"))
    image, _ = load_image(data)
    reference = scene.pixel_values(image)
    assert ours.dtype == reference.dtype == torch.float32
    assert ours.shape == reference.shape, name
    assert torch.equal(ours, reference), name


def test_draft_decoding_is_opt_in(scene) -> None:
    assert not scene.image_config.image_spec().jpeg_draft
    assert scene.image_config.image_spec(jpeg_draft=True).jpeg_draft

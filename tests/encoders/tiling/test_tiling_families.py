"""LLaVA-OneVision anyres and Idefics3 / SmolVLM splitting rules against the transformers
processors (torchvision and PIL backends): tile grid, tile count and visual-token count
for 60+ sizes from 1x1 to extreme panoramas and tall screenshots."""

from __future__ import annotations

import pytest
from PIL import Image
from transformers import (
    Idefics3ImageProcessor,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    SmolVLMImageProcessor,
)
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)

from encoders.image_spec import ImageSpec, placeholder_text
from encoders.tiling.anyres import anyres_layout
from encoders.tiling.idefics3 import idefics3_layout

# (width, height): degenerate, around tile edges, photos, panoramas, tall screenshots
SIZES = [
    (1, 1), (1, 2), (2, 1), (3, 7), (7, 3), (10, 10), (16, 9), (31, 32), (32, 32), (33, 32),
    (32, 33), (64, 32), (32, 64), (96, 32), (32, 96), (47, 95), (61, 33), (33, 61), (63, 64),
    (64, 64), (65, 64), (90, 50), (100, 30), (30, 100), (95, 90), (96, 96), (97, 96), (128, 127),
    (123, 457), (457, 123), (200, 50), (50, 200), (640, 480), (480, 640), (800, 600),
    (999, 1001), (1024, 768), (1280, 720), (720, 1280), (750, 1334), (1170, 2532),
    (1920, 1080), (1080, 1920), (1440, 3200), (2048, 1536), (3840, 1080), (4000, 3000),
    (3000, 4000), (5000, 500), (500, 5000), (3000, 100), (100, 3000), (1000, 1), (1, 1000),
    (2000, 13), (13, 2000), (4000, 10), (10, 4000), (8000, 40), (40, 8000),
]  # fmt: skip
TILE = 32
PINPOINTS = [[TILE * i, TILE * j] for i in range(1, 4) for j in range(1, 4)]
NUM_PATCHES = 16  # 4x4 patches per 32-px tile


# Past this many pixels only one backend runs (the rule does not depend on the backend).
HEAVY = 1_000_000


def _backends(processors: list, width: int, height: int) -> list:
    return processors if width * height <= HEAVY else processors[-1:]


def _image(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (200, 40, 90))


def test_sizes_cover_the_range() -> None:
    assert len(set(SIZES)) == len(SIZES) >= 50
    assert (1, 1) in SIZES and max(w / h for w, h in SIZES) >= 1000


@pytest.fixture(scope="module")
def llava_processors():
    kw = dict(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS)
    return [LlavaOnevisionImageProcessor(**kw), LlavaOnevisionImageProcessorPil(**kw)]


@pytest.mark.parametrize("max_patches", [2, 9])
def test_anyres_matches_transformers(llava_processors, max_patches: int) -> None:
    from transformers import PreTrainedTokenizerFast  # noqa: F401  (tokenizer not needed)

    counter = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    counter.image_processor = llava_processors[0]
    counter.num_image_tokens = NUM_PATCHES
    counter.vision_aspect_ratio = f"anyres_max_{max_patches}"
    for width, height in SIZES:
        layout = anyres_layout(width, height, tile_size=TILE, grid_pinpoints=PINPOINTS,
                               num_patches=NUM_PATCHES, max_num_patches=max_patches)  # fmt: skip
        assert layout.num_tokens == counter._get_number_of_features(height, width, TILE, TILE)
        if max_patches != 2:
            continue  # the grid does not depend on anyres_max
        for processor in _backends(llava_processors, width, height):
            out = processor(_image(width, height), return_tensors="pt")
            assert out["pixel_values"].shape[1] == layout.num_tiles, (width, height)
            assert tuple(out["image_sizes"][0].tolist()) == (height, width)
            rows, cols = layout.grid
            assert layout.best_resolution == (rows * TILE, cols * TILE)


def test_anyres_multi_image_prompt_is_base_tile_only(llava_processors) -> None:
    for width, height in [(40, 40), (100, 30), (1, 1000), (4000, 3000)]:
        layout = anyres_layout(
            width, height, tile_size=TILE, grid_pinpoints=PINPOINTS,
            num_patches=NUM_PATCHES, max_num_patches=9, multi_image=True,
        )  # fmt: skip
        assert (layout.num_tiles, layout.num_tokens) == (1, NUM_PATCHES + 1)
        side = max(width, height)
        left, top, right, bottom = layout.padding
        assert (left + width + right, top + height + bottom) == (side, side)
    out = llava_processors[0]([[_image(40, 40), _image(100, 30)]], return_tensors="pt")
    assert out["pixel_values"].shape[:2] == (2, 1)


def test_anyres_real_settings_token_counts() -> None:
    # llava-onevision-qwen2-7b-ov: 384-px tiles, 27x27 patches, 6x6 pinpoints, anyres_max_9
    pinpoints = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
    counter = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    counter.image_processor = LlavaOnevisionImageProcessor()
    counter.num_image_tokens, counter.vision_aspect_ratio = 729, "anyres_max_9"
    for width, height in SIZES:
        layout = anyres_layout(width, height, tile_size=384, grid_pinpoints=pinpoints,
                               num_patches=729, max_num_patches=9)  # fmt: skip
        assert layout.num_tokens == counter._get_number_of_features(height, width, 384, 384)
        assert layout.num_tiles <= 37


def _idefics3_processors(longest_edge: int, tile: int, split: bool, smolvlm: bool = False) -> list:
    kw = dict(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": tile},
              do_image_splitting=split)  # fmt: skip
    first = SmolVLMImageProcessor if smolvlm else Idefics3ImageProcessor
    return [first(**kw), Idefics3ImageProcessorPil(**kw)]


@pytest.mark.parametrize("split", [True, False])
def test_idefics3_matches_transformers(split: bool) -> None:
    processors = _idefics3_processors(3 * TILE, TILE, split)
    for width, height in SIZES:
        layout = idefics3_layout(width, height, longest_edge=3 * TILE, tile_size=TILE,
                                 tokens_per_tile=4, do_image_splitting=split)  # fmt: skip
        for processor in _backends(processors, width, height):
            out = processor([[_image(width, height)]], return_tensors="pt",
                            return_row_col_info=True)  # fmt: skip
            assert (out["rows"][0][0], out["cols"][0][0]) == layout.grid, (width, height)
            assert out["pixel_values"].shape[1] == layout.num_tiles, (width, height)
        assert layout.num_tokens == 4 * layout.num_tiles


@pytest.mark.slow
def test_idefics3_real_settings_grid() -> None:
    # Idefics3-8B / SmolVLM defaults: longest edge 4 * 364, 364-px tiles
    processors = _idefics3_processors(4 * 364, 364, True, smolvlm=True)
    for width, height in [(1, 1), (640, 480), (4000, 10), (10, 4000)]:
        layout = idefics3_layout(width, height, longest_edge=4 * 364, tile_size=364,
                                 tokens_per_tile=169)  # fmt: skip
        for processor in processors:
            out = processor([[_image(width, height)]], return_row_col_info=True)
            assert (out["rows"][0][0], out["cols"][0][0]) == layout.grid, (width, height)
        assert layout.num_tiles <= 17


def test_placeholder_text_matches_the_idefics3_processor() -> None:
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    spec = ImageSpec("idefics3", tile_size=TILE, resample=1, image_mean=(0.5,) * 3,
                     image_std=(0.5,) * 3, longest_edge=3 * TILE, image_seq_len=4)  # fmt: skip
    for width, height in [(1, 1), (90, 50), (33, 90), (4000, 10)]:
        layout = spec.layout(width, height)
        expected = get_image_prompt_string(*layout.grid, 4, "<fake_token_around_image>",
                                           "<image>", "<global-img>")  # fmt: skip
        assert placeholder_text(layout, "<image>") == expected
        assert placeholder_text(layout, "<image>").count("<image>") == layout.num_tokens


def test_rejects_empty_sizes() -> None:
    with pytest.raises(ValueError):
        idefics3_layout(0, 5, longest_edge=96, tile_size=32, tokens_per_tile=4)
    with pytest.raises(ValueError):
        anyres_layout(5, 0, tile_size=32, grid_pinpoints=PINPOINTS, num_patches=16,
                      max_num_patches=9)  # fmt: skip

"""Gemma 3 as a tiling family against transformers' Gemma3Processor (torchvision and PIL
image processors): from the header size alone, the pan-and-scan crops, the token count and
the expanded prompt's token ids, with pan-and-scan on and off, for 70+ sizes (1x1 to
extreme panoramas, and the edges of the rule: the 1.2 aspect ratio, the 256 px crop)."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from transformers import AutoProcessor, Gemma3Processor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from encoders.image_io import read_header
from encoders.image_spec import ImageSpec
from encoders.tiling.pan_and_scan import gemma3_prompt_text, pan_and_scan_layout
from tests.encoders.tiling.test_tiling_families import HEAVY, SIZES

# Around the rule's edges (processor defaults: min ratio 1.2, min crop 256, at most 4).
EDGES = [
    (600, 500), (599, 500), (500, 600), (500, 599), (512, 256), (511, 300), (509, 300),
    (300, 511), (300, 509), (1280, 256), (1024, 255), (2560, 300), (300, 2560), (769, 256),
    (256, 769), (767, 256), (1600, 400), (401, 1999),
]  # fmt: skip
TEXT = "what is in the picture"


@pytest.fixture(scope="module")
def processors(gemma3_path) -> list[Gemma3Processor]:
    """The checkpoint's processor (torchvision image processor, what AutoProcessor loads)
    and the same with the PIL image processor."""
    processor = AutoProcessor.from_pretrained(gemma3_path)
    ip = processor.image_processor
    pil = Gemma3ImageProcessorPil(size=dict(ip.size), resample=ip.resample,
                                  image_mean=ip.image_mean, image_std=ip.image_std)  # fmt: skip
    return [processor, Gemma3Processor(
        image_processor=pil, tokenizer=processor.tokenizer,
        image_seq_length=processor.image_seq_length, chat_template=processor.chat_template,
    )]  # fmt: skip


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG cut where its pixel data starts: only the header is there to read."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 200, 40)).save(buffer, format="PNG")
    data = buffer.getvalue()
    return data[: data.index(b"IDAT") + 4]


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_prompt_ids_from_the_header_equal_the_processors(processors, pan_and_scan) -> None:
    first = processors[0]
    spec = ImageSpec.from_hf(first, pan_and_scan=pan_and_scan)
    assert spec is not None and spec.family == "gemma3" and spec.tile_size == 32
    marker = first.image_token
    soft_id = first.tokenizer.convert_tokens_to_ids(spec.image_soft_token)
    content = [{"type": "image"}, {"type": "text", "text": TEXT}]
    prompt = first.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    num_cropped = 0
    for width, height in [*SIZES, *EDGES]:
        header = read_header(_png_header_only(width, height))
        layout = spec.layout(header.width, header.height)
        expanded = prompt.replace(marker, spec.prompt_text(layout, marker))
        ours = first.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        assert ours.count(soft_id) == layout.num_tokens == 16 * layout.num_tiles
        image = Image.new("RGB", (width, height), (200, 40, 90))
        backends = processors if width * height <= HEAVY else processors[:1]
        for processor in backends:
            out = processor(text=[prompt], images=[image], add_special_tokens=False,
                            do_pan_and_scan=pan_and_scan)  # fmt: skip
            assert out["input_ids"][0] == ours, (width, height, type(processor.image_processor))
            assert len(out["pixel_values"]) == layout.num_tiles, (width, height)
        num_cropped += len(layout.crops) > 0
    assert (num_cropped > 15) == pan_and_scan


def test_several_images_expand_in_order(processors) -> None:
    processor = processors[0]
    spec = ImageSpec.from_hf(processor, pan_and_scan=True)
    sizes = [(1000, 400), (50, 60), (300, 900)]
    content = [{"type": "image"}] * 3 + [{"type": "text", "text": TEXT}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    pieces = prompt.split(processor.image_token)
    layouts = [spec.layout(w, h) for w, h in sizes]
    assert [len(layout.crops) for layout in layouts] == [3, 0, 3]
    expanded = pieces[0] + "".join(
        spec.prompt_text(layout, processor.image_token) + piece
        for layout, piece in zip(layouts, pieces[1:], strict=True)
    )
    images = [Image.new("RGB", size, (20, 40, 60)) for size in sizes]
    out = processor(text=[prompt], images=images, add_special_tokens=False, do_pan_and_scan=True)
    ours = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert out["input_ids"][0] == ours


def test_prompt_text_is_the_processors_replacement(processors) -> None:
    processor = processors[0]
    tokens = dict(boi_token="<start_of_image>", eoi_token="<end_of_image>",
                  image_token="<image_soft_token>")  # fmt: skip
    assert gemma3_prompt_text(0, 16, **tokens) == processor.full_image_sequence
    for crops in (2, 3, 4):
        expected = processor.replace_image_token({"num_crops": [crops]}, image_idx=0)
        assert gemma3_prompt_text(crops, 16, **tokens) == expected


def test_real_settings_crop_counts() -> None:
    """The released checkpoints' settings (896 px, 256 tokens, crops of >= 256 px)."""
    expected = {(896, 896): 0, (1000, 400): 3, (400, 1000): 3, (1920, 1080): 2,
                (4000, 500): 4, (600, 500): 2, (599, 500): 0, (300, 200): 0}  # fmt: skip
    for (width, height), crops in expected.items():
        layout = pan_and_scan_layout(width, height, tokens_per_image=256, enabled=True)
        assert (len(layout.crops), layout.num_tokens) == (crops, 256 * (1 + crops))
        off = pan_and_scan_layout(width, height, tokens_per_image=256, enabled=False)
        assert (off.crops, off.num_tokens) == ((), 256)


def test_rejects_empty_sizes_and_bad_settings() -> None:
    with pytest.raises(ValueError):
        pan_and_scan_layout(0, 5, tokens_per_image=256, enabled=True)
    with pytest.raises(ValueError, match="three image tokens"):
        ImageSpec("gemma3", 896, 2, (0.5,) * 3, (0.5,) * 3, tokens_per_tile=256)

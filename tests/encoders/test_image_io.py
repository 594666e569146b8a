"""Decoding, typed errors and pixel parity with the transformers image processors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import Gemma3ImageProcessor, Idefics3ImageProcessor, LlavaOnevisionImageProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
    LlavaOnevisionImageProcessorPil,
)

from encoders import image_io
from encoders.errors import ImageDecodeError, ImageTooLargeError
from encoders.image_io import (
    CorruptImageError,
    TruncatedImageError,
    UnsupportedImageError,
    ZeroSizeImageError,
    decode_rgb,
    preprocess_bytes,
    read_header,
)
from encoders.image_spec import ImageSpec
from encoders.stage import normalize_tiles

TILE = 32
PINPOINTS = [[TILE * i, TILE * j] for i in range(1, 4) for j in range(1, 4)]


def encode(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


def scene(width: int, height: int, seed: int = 0) -> Image.Image:
    """A photo-like test card: gradients, shapes, some texture."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                     (x + y) * 127 // max(width + height - 2, 1)], -1)  # fmt: skip
    base = (base + rng.integers(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(base)
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 5, height // 5, width // 2, height // 2), fill=(250, 30, 30))
    draw.rectangle((width // 2, height // 2, width - 2, height - 2), outline=(0, 0, 0), width=2)
    return image


def llava_spec(**kw) -> ImageSpec:
    ip = LlavaOnevisionImageProcessor()
    return ImageSpec("llava_onevision", TILE, int(ip.resample), tuple(ip.image_mean),
                     tuple(ip.image_std), grid_pinpoints=tuple(map(tuple, PINPOINTS)),
                     num_patches=16, max_num_patches=4, **kw)  # fmt: skip


def idefics3_spec(**kw) -> ImageSpec:
    ip = Idefics3ImageProcessor()
    return ImageSpec("idefics3", TILE, int(ip.resample), tuple(ip.image_mean),
                     tuple(ip.image_std), longest_edge=3 * TILE, image_seq_len=4, **kw)  # fmt: skip


def hf_pixels(family: str, image: Image.Image) -> list[torch.Tensor]:
    if family == "llava_onevision":
        kw = dict(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS)
        processors = [LlavaOnevisionImageProcessor(**kw), LlavaOnevisionImageProcessorPil(**kw)]
        return [p(image, return_tensors="pt")["pixel_values"][0] for p in processors]
    kw = dict(size={"longest_edge": 3 * TILE}, max_image_size={"longest_edge": TILE})
    processors = [Idefics3ImageProcessor(**kw), Idefics3ImageProcessorPil(**kw)]
    return [p([[image]], return_tensors="pt")["pixel_values"][0] for p in processors]


@pytest.mark.parametrize("family", ["llava_onevision", "idefics3"])
@pytest.mark.parametrize("size", [(90, 50), (33, 90), (640, 480), (7, 300), (1000, 40)])
def test_pixels_match_the_transformers_processors(family, size) -> None:
    """Bit-identical to the PIL backend (same resample chain); within 2 grey levels of the
    torchvision backend, except where the two transformers backends differ from each
    other themselves (torch's bicubic on hard edges of a strongly squashed LLaVA base
    tile): there never more than they do."""
    spec = llava_spec() if family == "llava_onevision" else idefics3_spec()
    image = scene(*size)
    out = preprocess_bytes(encode(image), spec, multi_image=False)
    assert out.tiles.dtype == np.uint8
    ours = normalize_tiles(torch.from_numpy(out.tiles), spec, torch.device("cpu"))
    grey = torch.tensor(spec.image_std)[:, None, None] * 255  # normalised unit -> grey levels
    torchvision_backend, pil_backend = (p[: ours.shape[0]] for p in hf_pixels(family, image))
    assert torchvision_backend.shape == pil_backend.shape == ours.shape
    assert float(((ours - pil_backend).abs() * grey).max()) < 1e-3
    to_torchvision = (ours - torchvision_backend).abs() * grey
    between_backends = (pil_backend - torchvision_backend).abs() * grey
    assert float(to_torchvision.max()) <= float(between_backends.max()) + 1e-3
    assert float((to_torchvision > 2 + 1e-3).float().mean()) < 0.01


def gemma3_spec(tile: int, pan_and_scan: bool) -> ImageSpec:
    ip = Gemma3ImageProcessor()
    return ImageSpec("gemma3", tile, int(ip.resample), tuple(ip.image_mean), tuple(ip.image_std),
                     tokens_per_tile=16, pan_and_scan=pan_and_scan, boi_token="<b>",
                     eoi_token="<e>", image_soft_token="<i>")  # fmt: skip


# Gemma3Processor's images_kwargs: what its image processor is called with.
GEMMA3_PAN_AND_SCAN = dict(pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
                           pan_and_scan_min_ratio_to_activate=1.2)  # fmt: skip


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize(
    ("size", "pan_and_scan", "tile"),
    [((1000, 400), True, TILE), ((333, 901), True, TILE), ((641, 333), True, TILE),
     ((7, 300), True, TILE), ((90, 50), False, TILE), ((1000, 400), False, TILE),
     ((1500, 700), True, 896), ((500, 375), False, 896)],
)  # fmt: skip
def test_gemma3_pixels_are_the_transformers_processors(fmt, size, pan_and_scan, tile) -> None:
    """Gemma 3 (whole image, then its pan-and-scan crops, each squashed to one tile) from
    the same file's bytes: the resized pixels are bit-identical to both backends of
    transformers' Gemma3 image processor, and the normalised tensor to its default
    (torchvision: AutoProcessor's) bit for bit; the PIL backend's float ops round the last
    bit differently."""
    data = encode(scene(*size, seed=5), fmt, **({"quality": 90} if fmt != "PNG" else {}))
    spec = gemma3_spec(tile, pan_and_scan)
    out = preprocess_bytes(data, spec, multi_image=False)
    layout = spec.layout(*size)
    assert out.tiles.shape == (layout.num_tiles, tile, tile, 3)
    tiles = torch.from_numpy(out.tiles)
    ours = normalize_tiles(tiles, spec, torch.device("cpu"))
    kw = dict(size={"height": tile, "width": tile}, do_pan_and_scan=pan_and_scan,
              return_tensors="pt", **GEMMA3_PAN_AND_SCAN)  # fmt: skip
    grey = torch.tensor(spec.image_std)[:, None, None] * 255  # normalised unit -> grey levels
    for processor in (Gemma3ImageProcessor(), Gemma3ImageProcessorPil()):
        name = type(processor).__name__
        resized = processor(Image.open(io.BytesIO(data)), do_rescale=False, do_normalize=False,
                            **kw)["pixel_values"]  # fmt: skip
        assert torch.equal(resized.float(), tiles.permute(0, 3, 1, 2).float()), name
        hf = processor(Image.open(io.BytesIO(data)), **kw)
        assert hf["num_crops"].tolist() == [len(layout.crops)]
        if isinstance(processor, Gemma3ImageProcessor):
            assert torch.equal(ours, hf["pixel_values"]), name
        assert float(((ours - hf["pixel_values"]).abs() * grey).max()) < 1e-3, name


def test_header_gives_the_oriented_size_without_decoding() -> None:
    image = scene(60, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: the model sees 20 x 60
    data = encode(image, "JPEG", exif=exif.tobytes())
    header = read_header(data)
    assert (header.format, header.width, header.height, header.orientation) == ("JPEG", 20, 60, 6)
    decoded, _ = decode_rgb(data)
    assert decoded.size == (20, 60)


def test_jpeg_draft_decodes_smaller_only_when_targets_allow() -> None:
    data = encode(scene(1600, 1200), "JPEG", quality=90)
    assert decode_rgb(data, draft_size=(400, 300))[0].size == (400, 300)  # 1/4 scale
    assert decode_rgb(data, draft_size=(401, 300))[0].size == (800, 600)  # 1/2 only
    assert decode_rgb(data, draft_size=(1000, 900))[0].size == (1600, 1200)
    spec = idefics3_spec(jpeg_draft=True)  # longest edge 96: draft decodes at 1/8
    drafted = preprocess_bytes(data, spec, False).tiles.astype(int)
    full = preprocess_bytes(data, idefics3_spec(), False).tiles.astype(int)  # exact: default
    assert drafted.shape == full.shape and np.abs(drafted - full).mean() < 3


@pytest.mark.parametrize(
    "mode,expected",
    [("P", (200, 40, 90)), ("RGBA", (255, 255, 255)), ("LA", (255, 255, 255)),
     ("CMYK", None), ("L", (128, 128, 128)), ("I;16", (128, 128, 128))],
)  # fmt: skip
def test_modes_become_rgb(mode: str, expected) -> None:
    if mode == "P":
        image = Image.new("RGB", (8, 8), (200, 40, 90)).convert("P", palette=Image.ADAPTIVE)
    elif mode in ("RGBA", "LA"):
        image = Image.new(mode, (8, 8), (10, 0) if mode == "LA" else (10, 20, 30, 0))  # clear
    elif mode == "I;16":
        image = Image.fromarray(np.full((8, 8), 128 * 256, dtype=np.uint16))
    else:
        image = Image.new(mode, (8, 8), 128 if mode == "L" else (0, 0, 0, 0))
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    decoded, _ = decode_rgb(encode(image, fmt))
    assert decoded.mode == "RGB"
    if expected is not None:
        assert decoded.getpixel((3, 3)) == expected


@pytest.mark.parametrize("options", [{"quality": 85}, {"lossless": True}])
def test_webp_decodes_straight_to_rgb_with_pils_pixels(options) -> None:
    """Still opaque WebP bypasses PIL's animation decoder (libwebp straight to RGB): same
    pixels as PIL's own decode, EXIF orientation applied."""
    image = scene(90, 50, seed=3)
    exif = Image.Exif()
    exif[0x0112] = 8  # rotate 270: the model sees 50 x 90
    data = encode(image, "WEBP", exif=exif.tobytes(), **options)
    assert image_io._webp_rgb(data, Image.open(io.BytesIO(data))) is not None  # the fast path
    decoded, header = decode_rgb(data)
    reference = Image.open(io.BytesIO(data)).convert("RGB").transpose(Image.Transpose.ROTATE_90)
    assert (header.width, header.height) == decoded.size == (50, 90)
    assert decoded.mode == "RGB"
    assert np.array_equal(np.asarray(decoded), np.asarray(reference))


def test_webp_with_alpha_or_frames_goes_through_pil() -> None:
    clear = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    data = encode(clear, "WEBP", lossless=True)
    assert image_io._webp_rgb(data, Image.open(io.BytesIO(data))) is None
    assert decode_rgb(data)[0].getpixel((3, 3)) == (255, 255, 255)  # composited on white
    frames = [Image.new("RGB", (10, 10), c) for c in [(255, 0, 0), (0, 0, 255)]]
    buffer = io.BytesIO()
    frames[0].save(buffer, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    assert image_io._webp_rgb(buffer.getvalue(), Image.open(buffer)) is None
    assert decode_rgb(buffer.getvalue())[0].getpixel((5, 5)) == (255, 0, 0)


def test_first_frame_of_an_animation() -> None:
    frames = [Image.new("RGB", (10, 10), c) for c in [(255, 0, 0), (0, 0, 255)]]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=50)
    decoded, _ = decode_rgb(buffer.getvalue())
    assert decoded.getpixel((5, 5))[0] > 200


def test_bad_inputs_raise_typed_errors() -> None:
    jpeg = encode(scene(200, 150), "JPEG")
    with pytest.raises(TruncatedImageError, match="truncated"):
        decode_rgb(jpeg[: len(jpeg) // 2])
    with pytest.raises(UnsupportedImageError, match="cannot decode image"):
        read_header(b"definitely not an image")
    with pytest.raises(UnsupportedImageError, match="ICO is not supported"):
        read_header(encode(Image.new("RGB", (16, 16)), "ICO"))
    with pytest.raises(ZeroSizeImageError):
        read_header(b"")
    with pytest.raises(ImageTooLargeError, match="over the limit of 1000"):
        read_header(encode(Image.new("RGB", (100, 100))), max_pixels=1000)
    png = bytearray(encode(scene(40, 40)))
    start = png.index(b"IDAT") + 6
    png[start : start + 38] = b"\x13" * 38  # wreck the compressed pixel data
    with pytest.raises(CorruptImageError, match="corrupt"):
        decode_rgb(bytes(png))
    for error in (CorruptImageError, TruncatedImageError, UnsupportedImageError):
        assert issubclass(error, ImageDecodeError) and error.status == 400

"""VisionEncoder against transformers on tiny random checkpoints written by `save_pretrained`:
per-image embeddings equal what the HF model scatters into `inputs_embeds`, and their count
equals the placeholder tokens the HF processor puts in the prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    LlamaConfig,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    PreTrainedTokenizerFast,
    Qwen2Config,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)
from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

from encoders.connectors import pixel_shuffle
from encoders.siglip import SiglipConfig, SiglipTower, idefics3_position_ids, load_siglip_tower
from encoders.vision import VisionEncoder, VisionInput, vision_inputs_from_hf
from encoders.weights import CheckpointError, load_tensors, read_config

TILE = 32  # vision image_size; patch 8 -> 4x4 patches per tile
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32], [96, 96]]
IMAGE_TOKEN_ID = 99


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def random_image(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    # never blank: Idefics3 drops all-0.0 tiles
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def tiny_tokenizer(special: list[str]) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "hi": 1, **{tok: i + 2 for i, tok in enumerate(special)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


def siglip_kwargs() -> dict:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, image_size=TILE, patch_size=8)  # fmt: skip


def save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)  # safetensors
    return path


def build_llava(path: Path, **overrides: object) -> tuple[torch.nn.Module, VisionEncoder]:
    torch.manual_seed(0)
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**siglip_kwargs()).to_dict(),
        text_config=Qwen2Config(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
        ).to_dict(),  # fmt: skip
        image_token_index=IMAGE_TOKEN_ID,
        video_token_index=98,
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio="anyres_max_2",  # small cap so big grids get shrunk
        **overrides,
    )
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    save(model, path)
    encoder = VisionEncoder.from_checkpoint(read_config(path), load_tensors(path), torch.float32)
    return model, encoder


def llava_image_processor() -> LlavaOnevisionImageProcessor:
    return LlavaOnevisionImageProcessor(
        size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS
    )


def hf_llava_features(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model.model.get_image_features(
            batch["pixel_values"], batch["image_sizes"], batch_num_images=batch["batch_num_images"]
        )
    return list(out.pooler_output)


# (height, width): square, panorama, tall, odd, tiny, and one big enough to be shrunk
LLAVA_SIZES = [(40, 40), (20, 90), (100, 30), (37, 53), (10, 10), (90, 95)]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"vision_feature_layer": [-2, -1]}, {"vision_feature_layer": -3}],
    ids=["last-layer", "layer-list", "embeddings"],  # -3: HF treats layer 0 as "no states"
)
def test_llava_onevision_matches_transformers(tmp_path: Path, overrides: dict) -> None:
    model, encoder = build_llava(tmp_path, **overrides)
    rng = np.random.default_rng(0)
    images = [random_image(rng, h, w) for h, w in LLAVA_SIZES]
    processor = llava_image_processor()
    for batch_images in ([images[1]], images):  # one image alone, then all in one batch
        batch = processor(batch_images, return_tensors="pt")
        inputs = vision_inputs_from_hf("llava_onevision", batch)
        ours = encoder.encode(inputs)
        expected = hf_llava_features(model, batch)
        assert len(ours) == len(expected) == len(batch_images)
        for got, want, image in zip(ours, expected, inputs, strict=True):
            assert got.shape == want.shape
            assert encoder.num_image_tokens(image) == got.shape[0]
            close(got, want)
    # the big image really went through the bilinear shrink (16 base + up to 2 tiles' worth)
    assert ours[-1].shape[0] < 16 + 12 * 13


@pytest.mark.parametrize("strategy", ["full", "default"])
def test_llava_onevision_multi_image_prompt(tmp_path: Path, strategy: str) -> None:
    # several images in one prompt: base tile only (+ one newline), as transformers does
    model, encoder = build_llava(tmp_path, vision_feature_select_strategy=strategy)
    rng = np.random.default_rng(1)
    prompts = [[random_image(rng, 50, 20), random_image(rng, 33, 70)]]
    if strategy == "full":  # "default" + anyres fails inside transformers itself
        prompts.append([random_image(rng, 70, 40)])
    batch = llava_image_processor()(prompts, return_tensors="pt")
    inputs = vision_inputs_from_hf("llava_onevision", batch)
    assert [x.pixel_values.shape[0] for x in inputs[:2]] == [1, 1]
    ours = encoder.encode(inputs)
    for got, want in zip(ours, hf_llava_features(model, batch), strict=True):
        close(got, want)
    per_tile = 16 if strategy == "full" else 15
    assert [x.shape[0] for x in ours[:2]] == [per_tile + 1, per_tile + 1]


def test_llava_onevision_counts_match_processor_placeholders(tmp_path: Path) -> None:
    _, encoder = build_llava(tmp_path)
    processor = LlavaOnevisionProcessor(
        image_processor=llava_image_processor(),
        tokenizer=tiny_tokenizer(["<image>", "<video>"]),
        video_processor=LlavaOnevisionVideoProcessor(),
        num_image_tokens=16,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_2",
    )
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    rng = np.random.default_rng(2)
    for height, width in LLAVA_SIZES:
        image = random_image(rng, height, width)
        out = processor(text=["hi <image> hi"], images=[image], return_tensors="pt")
        num_placeholders = int((out["input_ids"] == image_id).sum())
        (embeds,) = encoder.encode(vision_inputs_from_hf("llava_onevision", out))
        assert embeds.shape == (num_placeholders, 48), (height, width)


def build_idefics3(path: Path, family: str) -> tuple[torch.nn.Module, VisionEncoder]:
    torch.manual_seed(0)
    text = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=100)  # fmt: skip
    config_cls, model_cls = {
        "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration),
        "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration),
    }[family]
    config = config_cls(
        vision_config=siglip_kwargs(),
        text_config=text.to_dict(),
        image_token_id=IMAGE_TOKEN_ID,
        scale_factor=2,
    )
    model = model_cls(config).eval()
    save(model, path)
    encoder = VisionEncoder.from_checkpoint(read_config(path), load_tensors(path), torch.float32)
    return model, encoder


def idefics3_image_processor(split: bool = True) -> Idefics3ImageProcessor:
    # longest edge -> 96, then (when splitting) 32x32 tiles + a 32x32 global tile
    return Idefics3ImageProcessor(
        do_image_splitting=split, max_image_size={"longest_edge": TILE}, size={"longest_edge": 96}
    )


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_idefics3_matches_transformers(tmp_path: Path, family: str) -> None:
    model, encoder = build_idefics3(tmp_path, family)
    rng = np.random.default_rng(3)
    # prompt 0: one image; prompt 1: panorama, tall, square
    prompts = [
        [random_image(rng, 40, 40)],
        [random_image(rng, 20, 90), random_image(rng, 100, 30), random_image(rng, 30, 30)],
    ]
    for split, tiles in [(True, [10, 4, 4, 10]), (False, [1, 1, 1, 1])]:
        processor = idefics3_image_processor(split)
        batch = processor(prompts, return_tensors="pt", return_row_col_info=True)
        assert batch["pixel_values"].shape[1] > tiles[0]  # prompt 0 is padded with blank tiles
        inputs = vision_inputs_from_hf("idefics3", batch)
        assert [x.pixel_values.shape[0] for x in inputs] == tiles
        ours = encoder.encode(inputs)
        with torch.no_grad():
            expected = model.model.get_image_features(
                batch["pixel_values"], batch["pixel_attention_mask"]
            ).pooler_output
        close(ours[0], expected[0])
        close(torch.cat(ours[1:]), expected[1])  # HF concatenates a prompt's images
        for got, image in zip(ours, inputs, strict=True):
            assert got.shape == (image.pixel_values.shape[0] * 4, 48)
            assert encoder.num_image_tokens(image) == got.shape[0]


def test_idefics3_counts_match_processor_placeholders(tmp_path: Path) -> None:
    _, encoder = build_idefics3(tmp_path, "idefics3")
    tokenizer = tiny_tokenizer(["<image>", "<fake_token_around_image>", "<global-img>"])
    rng = np.random.default_rng(4)
    for split in (True, False):
        processor = Idefics3Processor(idefics3_image_processor(split), tokenizer, image_seq_len=4)
        image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
        for height, width in [(40, 40), (20, 90), (100, 30), (30, 30)]:
            image = random_image(rng, height, width)
            out = processor(text=["hi <image> hi"], images=[[image]], return_tensors="pt")
            num_placeholders = int((out["input_ids"] == image_id).sum())
            (embeds,) = encoder.encode(vision_inputs_from_hf("idefics3", out))
            assert embeds.shape == (num_placeholders, 48), (split, height, width)


@pytest.mark.parametrize("side", [4, 19, 25, 26, 27, 32])
def test_idefics3_position_buckets_match_transformers(side: int) -> None:
    # HF buckets fractional coordinates; for some sides (19, 25, ...) that is not arange
    config = Idefics3Config(vision_config=dict(hidden_size=1, image_size=side, patch_size=1))
    embeddings = Idefics3VisionEmbeddings(config.vision_config)
    with torch.no_grad():
        embeddings.patch_embedding.weight.zero_()
        embeddings.patch_embedding.bias.zero_()
        embeddings.position_embedding.weight.copy_(torch.arange(side * side)[:, None])
        mask = torch.ones(1, side, side, dtype=torch.bool)
        hf_ids = embeddings(torch.zeros(1, 3, side, side), mask)[0, :, 0].long()
    assert torch.equal(idefics3_position_ids(side), hf_ids)


def test_siglip_tower_matches_transformers_when_patches_leave_a_margin() -> None:
    # like so400m-patch14-384 (27 patches of 14 = 378 < 384): the conv drops the margin
    from transformers import SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(**{**siglip_kwargs(), "image_size": 36, "num_hidden_layers": 3})
    hf = SiglipVisionModel(config).eval()
    tensors = hf.state_dict()
    pixel_values = torch.randn(5, 3, 36, 36)
    with torch.no_grad():
        out = hf(pixel_values, output_hidden_states=True)
        for post_norm in (True, False):
            tower = SiglipTower(SiglipConfig.from_hf(config.to_dict(), {}), post_norm=post_norm)
            load_siglip_tower(tower, tensors, prefix="")
            if post_norm:
                close(tower(pixel_values), out.last_hidden_state)
            else:
                states = tower.hidden_states(pixel_values, [-1, 0, 2])
                for got, i in zip(states, [-1, 0, 2], strict=True):
                    close(got, out.hidden_states[i])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("family", ["llava_onevision", "idefics3"])
def test_packed_encoder_matches_transformers(tmp_path: Path, family: str) -> None:
    # what the runner serves on CPU float32: the tower and connector linears prepacked;
    # another float32 summation order, so test_packed_linear's tolerance (atol 1e-5)
    rng = np.random.default_rng(6)
    images = [random_image(rng, 90, 95), random_image(rng, 20, 90)]
    if family == "llava_onevision":
        model, encoder = build_llava(tmp_path, vision_feature_layer=[-2, -1])
        batch = llava_image_processor()(images, return_tensors="pt")
        expected = hf_llava_features(model, batch)
    else:
        model, encoder = build_idefics3(tmp_path, family)
        batch = idefics3_image_processor()([images[:1]], return_tensors="pt")
        with torch.no_grad():
            expected = list(model.model.get_image_features(
                batch["pixel_values"], batch["pixel_attention_mask"]).pooler_output)  # fmt: skip
    assert encoder.pack_weights() == 4 * 2 + (2 if family == "llava_onevision" else 1)
    ours = encoder.encode(vision_inputs_from_hf(family, batch))
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pixel_shuffle_matches_transformers() -> None:
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    features = torch.randn(3, 36, 5)  # [tiles, 6x6 patches, dim]
    hf = Idefics3Connector.pixel_shuffle(None, features, scale_factor=3)
    assert torch.equal(pixel_shuffle(features, 3), hf)


def test_accepts_hub_key_prefixes(tmp_path: Path) -> None:
    # older hub checkpoints: 'vision_tower.vision_model.*'; newer layouts: 'model.*'
    model, encoder = build_llava(tmp_path)
    tensors = load_tensors(tmp_path)
    rng = np.random.default_rng(5)
    batch = llava_image_processor()([random_image(rng, 50, 70)], return_tensors="pt")
    inputs = vision_inputs_from_hf("llava_onevision", batch)
    expected = encoder.encode(inputs)[0]
    for old, new in [("vision_tower.", "vision_tower.vision_model."), ("", "model.")]:
        renamed = {
            (new + k[len(old) :] if k.startswith(old) and "language_model" not in k else k): v
            for k, v in tensors.items()
        }
        reloaded = VisionEncoder.from_checkpoint(read_config(tmp_path), renamed, torch.float32)
        assert torch.equal(reloaded.encode(inputs)[0], expected)


def test_checkpoint_errors_name_the_tensor(tmp_path: Path) -> None:
    build_idefics3(tmp_path, "idefics3")
    config, tensors = read_config(tmp_path), load_tensors(tmp_path)
    name = "model.vision_model.encoder.layers.1.self_attn.k_proj.weight"

    missing = {k: v for k, v in tensors.items() if k != name}
    with pytest.raises(CheckpointError, match=r"missing weight .*layers\.1\.self_attn\.k_proj"):
        VisionEncoder.from_checkpoint(config, missing, torch.float32)

    wrong = {**tensors, name: torch.zeros(32, 31)}
    with pytest.raises(CheckpointError) as err:
        VisionEncoder.from_checkpoint(config, wrong, torch.float32)
    assert name in str(err.value)
    assert "(32, 31)" in str(err.value) and "(32, 32)" in str(err.value)

    proj = "model.connector.modality_projection.proj.weight"
    with pytest.raises(CheckpointError, match=r"proj\.weight.*\(48, 7\).*\(48, 128\)"):
        VisionEncoder.from_checkpoint(config, {**tensors, proj: torch.zeros(48, 7)}, torch.float32)

    with pytest.raises(CheckpointError, match="unsupported architecture"):
        VisionEncoder.from_checkpoint({**config, "architectures": ["BertModel"]}, tensors)


def test_bad_inputs_are_value_errors(tmp_path: Path) -> None:
    _, encoder = build_llava(tmp_path)
    wrong_size = VisionInput(torch.randn(1, 3, 16, 16), image_size=(16, 16))
    with pytest.raises(ValueError, match=r"expected \[num_tiles, 3, 32, 32\]"):
        encoder.encode([wrong_size])
    with pytest.raises(ValueError, match="image_size"):
        encoder.encode([VisionInput(torch.randn(1, 3, TILE, TILE))])
    # a 20x90 panorama needs 1 + 1x3 tiles
    with pytest.raises(ValueError, match=r"needs 1 \+ 1x3 tiles"):
        encoder.encode([VisionInput(torch.randn(3, 3, TILE, TILE), image_size=(20, 90))])
    assert encoder.encode([]) == []

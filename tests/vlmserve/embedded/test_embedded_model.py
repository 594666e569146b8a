"""The shipped embedded checkpoint: loads with transformers and answers held-out scenes."""

from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmserve.embedded.evaluate import evaluate, generate_answers, heldout_scenes, load
from vlmserve.embedded.processor import SceneProcessor
from vlmserve.embedded.scenes import QUESTION_KINDS, caption, generate_scene, render_scene

MODEL_DIR = Path(__file__).parents[3] / "vlmserve" / "embedded" / "default_model"


@pytest.fixture(scope="module")
def model_and_processor():
    return load(MODEL_DIR)


def test_checkpoint_folder_is_complete_and_small():
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "loss_curve.png",
    ):
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 25 * 1024 * 1024


def test_config_is_idefics3_with_4_to_1_pixel_shuffle(model_and_processor):
    model, processor = model_and_processor
    config = model.config
    assert config.model_type == "idefics3" and config.scale_factor == 2
    assert config.text_config.num_key_value_heads < config.text_config.num_attention_heads
    assert config.image_token_id == processor.image_token_id
    assert processor.image_config.tokens_per_tile == 9


def test_processor_token_count_matches_size_rule():
    processor = SceneProcessor.from_pretrained(MODEL_DIR)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi?"}]}]
    for width, height, num_tiles in [(48, 48, 1), (96, 48, 3), (96, 96, 5), (600, 50, 13)]:
        image = Image.new("RGB", (width, height), (10, 20, 30))
        token_ids, pixel_values = processor.encode(messages, [image])
        assert processor.num_tiles(width, height) == num_tiles
        assert pixel_values[0].shape == (num_tiles, 3, 48, 48)
        num_image_tokens = token_ids.count(processor.image_token_id)
        assert num_image_tokens == processor.num_image_tokens(width, height) == 9 * num_tiles


def test_thumbnail_is_last_tile():
    processor = SceneProcessor.from_pretrained(MODEL_DIR)
    image = render_scene(generate_scene(3, width=96, height=96))
    tiles = processor.pixel_values(image)
    thumbnail = processor.pixel_values(image.resize((48, 48), Image.BICUBIC))[0]
    assert torch.equal(tiles[-1], thumbnail)


def test_inline_and_separate_images_encode_the_same():
    processor = SceneProcessor.from_pretrained(MODEL_DIR)
    image = render_scene(generate_scene(5))
    text = {"type": "text", "text": "What colour is the star?"}
    a = processor.encode([{"role": "user", "content": [{"type": "image"}, text]}], [image])
    b = processor.encode([{"role": "user", "content": [{"type": "image", "image": image}, text]}])
    assert a.token_ids == b.token_ids and torch.equal(a.pixel_values[0], b.pixel_values[0])
    with pytest.raises(ValueError):
        processor.encode([{"role": "user", "content": [text]}], [image])


@pytest.mark.slow
def test_single_prompt_generate_answers_caption(model_and_processor):
    model, processor = model_and_processor
    scene = heldout_scenes(1)[0]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}],
        }
    ]
    token_ids, pixel_values = processor.encode(messages, [render_scene(scene)])
    input_ids = torch.tensor([token_ids])
    out = model.generate(
        input_ids=input_ids,
        pixel_values=torch.cat(pixel_values)[None],
        max_new_tokens=40,
        do_sample=False,
    )
    assert processor.decode(out[0, input_ids.shape[1] :]) == caption(scene)


@pytest.mark.slow
def test_batched_answers_equal_one_by_one(model_and_processor):
    model, processor = model_and_processor
    images = [render_scene(s) for s in heldout_scenes(3)]
    prompts = ["Describe the image.", "How many stars are there?", "what word is written?"]
    batched = generate_answers(
        model, processor, prompts * 3, [im for im in images for _ in range(3)]
    )
    singles = [generate_answers(model, processor, [p], [im])[0] for im in images for p in prompts]
    assert batched == singles


@pytest.fixture(scope="module")
def heldout_scores(model_and_processor):
    model, processor = model_and_processor
    return evaluate(model, processor, heldout_scenes(20))


# Question kinds the shipped checkpoint does not yet answer at the target rate (see the
# accuracy table in default_model/README.md). strict: an improved checkpoint turns these
# into failures, so the marker is removed together with the gap.
BELOW_TARGET: set[str] = set()


@pytest.mark.slow
def test_answers_20_heldout_captions(heldout_scores):
    assert heldout_scores.total["caption"] == 20
    assert heldout_scores.correct["caption"] >= 18, heldout_scores.failures


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(k, marks=pytest.mark.xfail(strict=True, reason="below target"))
        if k in BELOW_TARGET
        else k
        for k in QUESTION_KINDS
    ],
)
def test_answers_20_heldout_questions(heldout_scores, kind):
    assert heldout_scores.total[kind] >= 10, kind
    # ">= 19/20 per question type": at most one miss of each kind
    misses = heldout_scores.total[kind] - heldout_scores.correct[kind]
    assert misses <= 1, [f for f in heldout_scores.failures if f[1] == kind]

"""The embedded default model served by the engine: same answers as transformers, token
for token, and the captions of held-out scenes right."""

from __future__ import annotations

import pytest

from encoders.images import load_image
from tests.helpers import chat, make_engine
from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.embedded.evaluate import CAPTION_PROMPT, generate_answers, heldout_scenes, load
from vlmserve.embedded.scenes import caption, heldout_questions, render_scene
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(
        DEFAULT_MODEL_DIR, num_blocks=2048, block_size=16, budget=1024, max_num_seqs=64
    )


def ask(image, prompt: str) -> Request:
    return chat([image], prompt, GREEDY)


def queries(scenes) -> list[tuple[object, str, str, str]]:
    """(image, kind, prompt, expected answer) for the caption and every held-out question."""
    rows = []
    for scene in scenes:
        image = render_scene(scene)
        rows.append((image, "caption", CAPTION_PROMPT, caption(scene)))
        rows += [(image, q.kind, q.question, q.answer) for q in heldout_questions(scene)]
    return rows


@pytest.mark.slow
def test_engine_answers_equal_transformers_and_captions_are_right(engine):
    rows = queries(heldout_scenes(20))
    outputs = engine.generate([ask(image, prompt) for image, _, prompt, _ in rows])
    assert all(o.error is None and o.finish_reason == "stop" for o in outputs)
    answers = [o.text.strip() for o in outputs]
    model, processor = load(DEFAULT_MODEL_DIR)
    reference = generate_answers(model, processor, [r[2] for r in rows], [r[0] for r in rows])
    # The engine (paged KV, continuous batching, timm tower) serves exactly the reference
    # model's answers, so its accuracy is the reference's (graded in test_embedded_model).
    assert answers == reference
    captions = [a == r[3] for a, r in zip(answers, rows, strict=True) if r[1] == "caption"]
    assert len(captions) == 20 and sum(captions) >= 18
    bm = engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.slow
def test_multi_tile_scene_prefix_cache_and_images_counted(engine):
    [scene] = heldout_scenes(1, multi_tile=True)
    image = render_scene(scene)
    [first] = engine.generate([ask(image, CAPTION_PROMPT)])
    [second] = engine.generate([ask(image, "what word is written?")])
    processor = engine.processor.scene
    assert first.num_image_tokens == processor.num_image_tokens(*image.size)
    assert first.num_image_tokens == 9 * processor.num_tiles(*image.size)
    # The second question about the same image reuses the image's KV blocks.
    assert second.num_cached_tokens >= second.num_image_tokens - 16


def _engine(**encoder) -> Engine:
    return make_engine(
        DEFAULT_MODEL_DIR, num_blocks=512, block_size=16, budget=1024, encoder=encoder
    )


@pytest.mark.slow
def test_files_go_through_the_pool_and_the_encoder_cache(tmp_path):
    """The default model takes the same image path as every other: header-only token
    count, tiles from the pool, embeddings from the encoder cache on a repeat; the token
    ids and answers are SceneProcessor's."""
    [scene] = heldout_scenes(1, multi_tile=True)
    path = tmp_path / "scene.jpg"
    render_scene(scene).save(path, quality=90)
    question = heldout_questions(scene)[0]
    pooled = _engine(num_workers=1)
    request = ask(str(path), CAPTION_PROMPT)
    prepared = pooled.processor.process(request)
    processor = pooled.processor.scene
    image, _ = load_image(path)
    message = {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": CAPTION_PROMPT}],
    }
    assert prepared.token_ids == processor.encode([message], images=[image]).token_ids
    for work in prepared.works:  # queued on its header: its tiles may still be coming
        work.wait()
    before = pooled.stats()["preprocess_images"]  # the pool is shared by the process
    [first] = pooled.generate([request])
    [second] = pooled.generate([ask(str(path), question.question)])
    stats = pooled.stats()
    assert stats["preprocess_workers"] == 1 and stats["preprocess_images"] == before + 1
    assert (stats["encoder_cache_misses"], stats["encoder_cache_hits"]) == (1, 1)
    assert first.text.strip() == caption(scene) and second.text.strip() == question.answer
    # No pool (tiles made inline) and SceneProcessor's own PIL path: the same answers.
    for encoder in ({"num_workers": 0}, {"use_pool": False}):
        engine = _engine(**encoder)
        outs = engine.generate([ask(str(path), CAPTION_PROMPT), ask(str(path), question.question)])
        assert [o.token_ids for o in outs] == [first.token_ids, second.token_ids], encoder
        assert engine.processor.pool_metrics() == {}

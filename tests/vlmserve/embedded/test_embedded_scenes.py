"""Scene generator: deterministic per seed, captions and questions follow the grammar."""

import re

import numpy as np
import pytest

from vlmserve.embedded.scenes import (
    COLOURS,
    HELDOUT_SEED_BASE,
    NUMBERS,
    PLURALS,
    POSITION_PHRASES,
    POSITIONS,
    QUESTION_KINDS,
    SHAPES,
    WORDS,
    ask,
    caption,
    generate_scene,
    heldout_questions,
    render_scene,
    vocabulary,
)

_COLOUR = "|".join(COLOURS)
_SHAPE = "|".join(SHAPES)
_POSITION = "|".join(POSITIONS)
_OBJECT = rf"(?:{_COLOUR}) (?:{_SHAPE}) at (?:{_POSITION})"
CAPTION_GRAMMAR = re.compile(rf"^{_OBJECT}(?:, {_OBJECT})*(?:, word (?:{'|'.join(WORDS)}))?\.$")


def test_same_seed_same_scene_and_pixels():
    a, b = generate_scene(1234), generate_scene(1234)
    assert a == b
    assert np.array_equal(np.asarray(render_scene(a)), np.asarray(render_scene(b)))
    assert heldout_questions(a) == heldout_questions(b)


def test_different_seeds_differ():
    captions = {caption(generate_scene(seed)) for seed in range(50)}
    assert len(captions) > 40


def test_size_changes_rendering_not_content():
    small, wide = generate_scene(7), generate_scene(7, width=300, height=90)
    assert small.objects == wide.objects and small.word == wide.word
    assert render_scene(wide).size == (300, 90)
    assert render_scene(small).size == (48, 48)


@pytest.mark.parametrize("seed", range(200))
def test_caption_follows_grammar_and_reading_order(seed):
    scene = generate_scene(seed)
    text = caption(scene)
    assert CAPTION_GRAMMAR.match(text), text
    positions = [obj.position for obj in scene.objects]
    assert positions == [p for p in POSITIONS if p in positions]  # reading order, no repeats
    assert 1 <= len(scene.objects) <= 4
    assert set(text.replace(",", " ,").replace(".", " .").split()) <= set(vocabulary())


def test_questions_are_consistent_with_the_scene():
    seen_kinds = set()
    for seed in range(300):
        scene = generate_scene(seed)
        for pair in heldout_questions(scene):
            seen_kinds.add(pair.kind)
            if pair.kind == "colour":
                shape = pair.question.removeprefix("what colour is the ").removesuffix("?")
                assert scene.count(shape) == 1
                assert pair.answer == next(o.colour for o in scene.objects if o.shape == shape)
            elif pair.kind == "position":
                shape = pair.question.removeprefix("where is the ").removesuffix("?")
                assert pair.answer == next(o.position for o in scene.objects if o.shape == shape)
            elif pair.kind == "count":
                plural = pair.question.split()[2]
                shape = next(s for s, p in PLURALS.items() if p == plural)
                assert pair.answer == NUMBERS[scene.count(shape)]
            elif pair.kind == "shape":
                phrase = pair.question.removeprefix("what shape is ").removesuffix("?")
                position = next(p for p, text in POSITION_PHRASES.items() if text == phrase)
                obj = scene.object_at(position)
                assert pair.answer == (obj.shape if obj else "nothing")
            else:
                assert pair.answer == (scene.word or "none")
    assert seen_kinds == set(QUESTION_KINDS)


def test_answer_mix_covers_zero_counts_absent_words_and_all_counts():
    rng = np.random.default_rng(0)
    counts = [ask(generate_scene(s), "count", rng).answer for s in range(400)]
    assert set(counts) == set(NUMBERS)
    assert 0.2 < counts.count("zero") / len(counts) < 0.6
    words = [heldout_questions(generate_scene(s))[-1].answer for s in range(100)]
    assert "none" in words and len(set(words)) > 4


def test_heldout_seeds_are_outside_training_range():
    from vlmserve.embedded.scenes import TRAIN_SEED_LIMIT

    assert HELDOUT_SEED_BASE >= TRAIN_SEED_LIMIT


def test_rejects_empty_size():
    with pytest.raises(ValueError):
        generate_scene(0, width=0)

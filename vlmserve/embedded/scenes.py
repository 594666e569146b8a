"""Seeded scene generator for the embedded default model.

A scene is a 3×3 grid of cells over the image. Objects (coloured shapes) sit centred in five
of the cells (top, left, centre, right, bottom); an optional two-letter word sits in the
top-left corner cell. The layout is drawn in a square canonical frame and then resized to the
requested width × height, so that at the model's 48-px tile each cell is exactly 16×16 px:
2×2 ViT patches of 8 px, i.e. one visual token after the 4:1 pixel shuffle. At other sizes
the global thumbnail of the tiling reproduces the canonical frame.

Every scene has a ground-truth caption in a fixed grammar and question/answer pairs:

    caption   "red circle at top, blue star at left, word hi."
    colour    "what colour is the star?"          -> "blue"   (only for a shape present once)
    shape     "what shape is on the left?"        -> "star" | "nothing"
    position  "where is the star?"                -> "left"   (only for a shape present once)
    count     "how many circles are there?"       -> "zero" .. "four"
    word      "what word is written?"             -> "hi" | "none"

Everything is a pure function of the seed (numpy `default_rng`), PIL + numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SHAPES = ("circle", "square", "triangle", "star", "cross")
PLURALS = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "star": "stars",
    "cross": "crosses",
}
COLOURS = {
    "red": (225, 35, 35),
    "green": (40, 200, 60),
    "blue": (45, 95, 240),
    "yellow": (240, 220, 30),
    "purple": (170, 60, 220),
    "white": (245, 245, 245),
}
# Reading order of the caption; (row, col) of each position's cell in the 3×3 grid.
POSITIONS = ("top", "left", "centre", "right", "bottom")
POSITION_CELLS = {
    "top": (0, 1),
    "left": (1, 0),
    "centre": (1, 1),
    "right": (1, 2),
    "bottom": (2, 1),
}
POSITION_PHRASES = {
    "top": "at the top",
    "left": "on the left",
    "centre": "in the centre",
    "right": "on the right",
    "bottom": "at the bottom",
}
WORD_CELL = (0, 0)
WORDS = ("hi", "go", "up", "ok", "no", "we")
NUMBERS = ("zero", "one", "two", "three", "four")
SIZES = {"small": 0.34, "big": 0.46}  # object radius as a fraction of the cell side
BACKGROUNDS = ("plain", "stripes", "checks", "noise")
MAX_OBJECTS = 4

QuestionKind = Literal["colour", "shape", "position", "count", "word"]
QUESTION_KINDS: tuple[QuestionKind, ...] = ("colour", "shape", "position", "count", "word")

CANONICAL_SIZE = 48  # the layout unit: one 48-px tile, 16-px cells
TRAIN_SEED_LIMIT = 1_000_000_000  # training seeds are < this; held-out seeds are >= it
HELDOUT_SEED_BASE = TRAIN_SEED_LIMIT


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    position: str
    size: Literal["small", "big"]


@dataclass(frozen=True)
class Scene:
    """A scene description; `render_scene` draws it, `caption` describes it."""

    seed: int
    objects: tuple[SceneObject, ...]  # in POSITIONS order, at most one per position
    word: str | None
    background: str
    background_level: int  # grey level of the (dark) background
    width: int
    height: int

    def count(self, shape: str) -> int:
        return sum(obj.shape == shape for obj in self.objects)

    def object_at(self, position: str) -> SceneObject | None:
        return next((obj for obj in self.objects if obj.position == position), None)

    def unique_shapes(self) -> list[str]:
        return [s for s in SHAPES if self.count(s) == 1]


@dataclass(frozen=True)
class QAPair:
    kind: QuestionKind
    question: str
    answer: str


def generate_scene(
    seed: int, *, width: int = CANONICAL_SIZE, height: int = CANONICAL_SIZE
) -> Scene:
    """The scene for `seed`, to be rendered at width × height (content does not depend on size)."""
    if width < 1 or height < 1:
        raise ValueError(f"scene size must be positive, got {width}x{height}")
    rng = np.random.default_rng([seed, 0])
    num_objects = int(rng.integers(1, MAX_OBJECTS + 1))
    # A dominant shape repeated 1..num_objects times, so counts 1-4 of a kind all occur.
    dominant = SHAPES[int(rng.integers(len(SHAPES)))]
    num_dominant = int(rng.integers(1, num_objects + 1))
    shapes = [dominant] * num_dominant + [
        SHAPES[int(rng.integers(len(SHAPES)))] for _ in range(num_objects - num_dominant)
    ]
    rng.shuffle(shapes)
    chosen = sorted(rng.choice(len(POSITIONS), size=num_objects, replace=False).tolist())
    colour_names = list(COLOURS)
    objects = tuple(
        SceneObject(
            shape=shape,
            colour=colour_names[int(rng.integers(len(colour_names)))],
            position=POSITIONS[pos_index],
            size="big" if rng.random() < 0.5 else "small",
        )
        for shape, pos_index in zip(shapes, chosen, strict=True)
    )
    word = WORDS[int(rng.integers(len(WORDS)))] if rng.random() < 0.5 else None
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    level = int(rng.integers(15, 75))
    return Scene(seed, objects, word, background, level, width, height)


def caption(scene: Scene) -> str:
    """Fixed grammar: '<colour> <shape> at <position>' in POSITIONS order, then 'word <w>'."""
    parts = [f"{obj.colour} {obj.shape} at {obj.position}" for obj in scene.objects]
    if scene.word is not None:
        parts.append(f"word {scene.word}")
    return ", ".join(parts) + "."


def ask(scene: Scene, kind: QuestionKind, rng: np.random.Generator) -> QAPair | None:
    """One question of `kind` about `scene` (None where the kind does not apply)."""
    if kind in ("colour", "position"):
        unique = scene.unique_shapes()
        if not unique:
            return None
        shape = unique[int(rng.integers(len(unique)))]
        obj = next(o for o in scene.objects if o.shape == shape)
        if kind == "colour":
            return QAPair(kind, f"what colour is the {shape}?", obj.colour)
        return QAPair(kind, f"where is the {shape}?", obj.position)
    if kind == "shape":
        occupied = [o.position for o in scene.objects]
        empty = [p for p in POSITIONS if p not in occupied]
        # Mostly occupied cells; sometimes an empty one, answered "nothing".
        pool = empty if empty and rng.random() < 0.2 else occupied
        position = pool[int(rng.integers(len(pool)))]
        obj = scene.object_at(position)
        answer = obj.shape if obj is not None else "nothing"
        return QAPair(kind, f"what shape is {POSITION_PHRASES[position]}?", answer)
    if kind == "count":
        present = sorted({o.shape for o in scene.objects})
        # Half present shapes, half any shape: "zero" answers are about 40% of counts.
        pool = present if rng.random() < 0.5 else list(SHAPES)
        shape = pool[int(rng.integers(len(pool)))]
        return QAPair(kind, f"how many {PLURALS[shape]} are there?", NUMBERS[scene.count(shape)])
    if kind == "word":
        return QAPair(kind, "what word is written?", scene.word or "none")
    raise ValueError(f"unknown question kind {kind!r}")


def heldout_questions(scene: Scene) -> list[QAPair]:
    """The evaluation questions of a scene: one per applicable kind, fixed by its seed."""
    rng = np.random.default_rng([scene.seed, 1])
    pairs = [ask(scene, kind, rng) for kind in QUESTION_KINDS]
    return [pair for pair in pairs if pair is not None]


def render_scene(scene: Scene) -> Image.Image:
    """Draw the scene as an RGB image of scene.width × scene.height."""
    # Supersample the canonical frame (anti-aliased edges), enough for the output size.
    scale = max(4, math.ceil(max(scene.width, scene.height) / CANONICAL_SIZE))
    scale = min(scale, 2048 // CANONICAL_SIZE)
    side = CANONICAL_SIZE * scale
    image = Image.fromarray(_background(scene, scale), mode="RGB")
    draw = ImageDraw.Draw(image)
    cell = side / 3
    for obj in scene.objects:
        row, col = POSITION_CELLS[obj.position]
        centre = ((col + 0.5) * cell, (row + 0.5) * cell)
        _draw_shape(draw, obj.shape, centre, SIZES[obj.size] * cell, COLOURS[obj.colour])
    if scene.word is not None:
        row, col = WORD_CELL
        font = ImageFont.load_default(size=max(6, round(0.62 * cell)))
        centre = ((col + 0.5) * cell, (row + 0.5) * cell)
        draw.text(centre, scene.word, fill=(210, 210, 210), font=font, anchor="mm")
    return image.resize((scene.width, scene.height), Image.Resampling.BICUBIC, reducing_gap=2.0)


def _background(scene: Scene, scale: int) -> np.ndarray:
    """[side, side, 3] uint8 dark background; textures are aligned to the 8-px patch grid."""
    rng = np.random.default_rng([scene.seed, 2])
    side = CANONICAL_SIZE * scale
    base = np.full((CANONICAL_SIZE, CANONICAL_SIZE), float(scene.background_level))
    ys, xs = np.mgrid[0:CANONICAL_SIZE, 0:CANONICAL_SIZE]
    if scene.background == "stripes":
        base += 14.0 * (((xs + ys) // 4) % 2)
    elif scene.background == "checks":
        base += 14.0 * (((xs // 8) + (ys // 8)) % 2)
    elif scene.background == "noise":
        base += (
            rng.uniform(-12, 12, size=(CANONICAL_SIZE // 4, CANONICAL_SIZE // 4))
            .repeat(4, axis=0)
            .repeat(4, axis=1)
        )
    tint = rng.uniform(0.8, 1.2, size=3)  # a slight colour cast per scene
    pixels = np.clip(base[..., None] * tint, 0, 255).astype(np.uint8)
    return pixels.repeat(scale, axis=0).repeat(scale, axis=1).reshape(side, side, 3)


def _draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    centre: tuple[float, float],
    radius: float,
    fill: tuple[int, int, int],
) -> None:
    cx, cy = centre
    r = radius
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        h = 0.82 * r
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif shape == "triangle":
        draw.polygon(
            [(cx, cy - r), (cx - 0.95 * r, cy + 0.8 * r), (cx + 0.95 * r, cy + 0.8 * r)], fill=fill
        )
    elif shape == "star":
        points = []
        for i in range(10):
            radius_i = r if i % 2 == 0 else 0.42 * r
            angle = -math.pi / 2 + i * math.pi / 5
            points.append((cx + radius_i * math.cos(angle), cy + radius_i * math.sin(angle)))
        draw.polygon(points, fill=fill)
    elif shape == "cross":
        w = 0.34 * r
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def vocabulary() -> list[str]:
    """Every word the captions, questions and answers can use (for the tokenizer)."""
    words: set[str] = set(SHAPES) | set(PLURALS.values()) | set(COLOURS) | set(POSITIONS)
    words |= set(WORDS) | set(NUMBERS)
    words |= {"at", "word", "what", "colour", "is", "the", "shape", "on", "in", "where"}
    words |= {"how", "many", "are", "there", "written", "nothing", "none", ",", ".", "?"}
    return sorted(words)

"""Training batches for the embedded model: scenes -> tiles + supervised prompt/answer rows.

One image is encoded once by the vision tower and shared by several rows (a caption and a few
questions about it), which makes the vision work per supervised answer small. Rows go into
padded buckets by (multi-tile image, caption or question) so that a 13-tile image or a long
caption does not pad every short row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlmserve.embedded.processor import SceneProcessor
from vlmserve.embedded.scenes import (
    CANONICAL_SIZE,
    QUESTION_KINDS,
    TRAIN_SEED_LIMIT,
    QAPair,
    Scene,
    ask,
    caption,
    generate_scene,
    render_scene,
)

CAPTION_PROMPT = "Describe the image."
IGNORE_INDEX = -100


@dataclass(frozen=True)
class DataMix:
    """What a training batch holds."""

    batch_size: int = 32  # images per step
    varied_fraction: float = 0.08  # images at a random size/aspect (mostly multi-tile)
    questions_per_image: int = 1  # plus one caption row per canonical (48-px) image
    rows_per_varied_image: int = 2
    answer_weight: float = 3.0  # loss weight of question-answer tokens vs caption tokens
    # Question kinds asked many times about each image (duplicates dropped), so one image
    # carries e.g. "what colour is the star?" and "what colour is the circle?" side by side
    # and the answer can only come from looking the cell up by the shape named. With focus
    # kinds set, every other kind is asked once and `questions_per_image` is not used.
    focus_kinds: tuple[str, ...] = ()
    draws_per_focus_kind: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1 or not 0.0 <= self.varied_fraction <= 1.0:
            raise ValueError(f"bad batch_size/varied_fraction: {self}")
        if set(self.focus_kinds) - set(QUESTION_KINDS):
            raise ValueError(f"unknown focus kinds: {self.focus_kinds}")
        if self.focus_kinds and self.draws_per_focus_kind < 1:
            raise ValueError(f"focus_kinds need draws_per_focus_kind >= 1: {self}")


@dataclass(frozen=True)
class Bucket:
    """Padded rows, [num_rows, max_len]; `image_index` says whose tile features each row uses."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor  # per-label loss weight, 0 where ignored
    attention_mask: torch.Tensor
    image_index: list[int]


@dataclass(frozen=True)
class Batch:
    pixel_values: torch.Tensor  # [num_tiles_total, 3, S, S]
    num_tiles: list[int]  # per image
    buckets: list[Bucket]


def sample_size(rng: np.random.Generator, image_size: int, max_tiles: int) -> tuple[int, int]:
    """A random size/aspect: thumbnails, panoramas, tall screenshots (1 to max_tiles grids)."""
    cols = int(rng.integers(1, max_tiles + 1))
    rows = int(rng.integers(1, max_tiles // cols + 1))
    if rng.random() < 0.5:
        cols, rows = rows, cols
    scale = float(rng.uniform(0.7, 1.5)) * image_size
    width = max(8, round(cols * scale * rng.uniform(0.9, 1.1)))
    height = max(8, round(rows * scale * rng.uniform(0.9, 1.1)))
    return width, height


class BatchMaker:
    """Deterministic batches: batch `step` is a pure function of (seed, step)."""

    def __init__(self, processor: SceneProcessor, mix: DataMix, seed: int) -> None:
        self.processor = processor
        self.mix = mix
        self.seed = seed
        self._ids_cache: dict[str, list[int]] = {}

    def __call__(self, step: int) -> Batch:
        rng = np.random.default_rng([self.seed, step])
        tiles: list[torch.Tensor] = []
        # Buckets by (multi-tile image, caption row): rows of similar length pad little.
        groups: dict[tuple[bool, bool], list[tuple[int, list[int], list[int], float]]] = {}
        config = self.processor.image_config
        for index in range(self.mix.batch_size):
            varied = rng.random() < self.mix.varied_fraction
            size = (CANONICAL_SIZE, CANONICAL_SIZE)
            if varied:
                size = sample_size(rng, config.image_size, config.max_num_tiles)
            scene = generate_scene(
                int(rng.integers(TRAIN_SEED_LIMIT)), width=size[0], height=size[1]
            )
            pixel_values = self.processor.pixel_values(render_scene(scene))
            tiles.append(pixel_values)
            rows = self._rows(scene, rng, varied)
            image_prompt = self.processor.image_prompt_ids(pixel_values.shape[0])
            for question, answer, weight in rows:
                prompt = self._ids("<|user|>") + image_prompt + self._ids(f" {question} <end>")
                prompt += self._ids("<|assistant|>")
                key = (pixel_values.shape[0] > 1, question == CAPTION_PROMPT)
                row = (index, prompt, self._ids(f" {answer} <end>"), weight)
                groups.setdefault(key, []).append(row)
        buckets = [self._pad(groups[key]) for key in sorted(groups)]
        return Batch(torch.cat(tiles), [t.shape[0] for t in tiles], buckets)

    def _rows(
        self, scene: Scene, rng: np.random.Generator, varied: bool
    ) -> list[tuple[str, str, float]]:
        rows: list[tuple[str, str, float]] = []
        if self.mix.focus_kinds:
            pairs = self._focus_pairs(scene, rng)
            if not varied:
                rows.append((CAPTION_PROMPT, caption(scene), 1.0))
                return rows + [(p.question, p.answer, self.mix.answer_weight) for p in pairs]
        else:
            kinds = list(QUESTION_KINDS)
            rng.shuffle(kinds)
            pairs = [p for p in (ask(scene, kind, rng) for kind in kinds) if p is not None]
        if varied:
            options = [(CAPTION_PROMPT, caption(scene), 1.0)]
            options += [(p.question, p.answer, self.mix.answer_weight) for p in pairs]
            order = rng.permutation(len(options))[: self.mix.rows_per_varied_image]
            return [options[i] for i in order]
        rows.append((CAPTION_PROMPT, caption(scene), 1.0))
        rows += [(p.question, p.answer, self.mix.answer_weight) for p in pairs]
        return rows[: 1 + self.mix.questions_per_image]

    def _focus_pairs(self, scene: Scene, rng: np.random.Generator) -> list[QAPair]:
        """Each focus kind asked `draws_per_focus_kind` times (distinct questions), others once."""
        pairs: dict[str, QAPair] = {}
        for kind in QUESTION_KINDS:
            draws = self.mix.draws_per_focus_kind if kind in self.mix.focus_kinds else 1
            for _ in range(draws):
                pair = ask(scene, kind, rng)
                if pair is not None:
                    pairs.setdefault(pair.question, pair)
        order = rng.permutation(len(pairs))
        values = list(pairs.values())
        return [values[i] for i in order]

    def _ids(self, text: str) -> list[int]:
        if text not in self._ids_cache:
            tokenizer = self.processor.tokenizer
            self._ids_cache[text] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._ids_cache[text]

    def _pad(self, rows: list[tuple[int, list[int], list[int], float]]) -> Bucket:
        length = max(len(prompt) + len(answer) for _, prompt, answer, _ in rows)
        pad = self.processor.pad_token_id
        input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        weights = torch.zeros((len(rows), length))
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for r, (_, prompt, answer, weight) in enumerate(rows):
            n, m = len(prompt), len(answer)
            input_ids[r, : n + m] = torch.tensor(prompt + answer)
            labels[r, n : n + m] = torch.tensor(answer)
            weights[r, n : n + m] = weight
            attention_mask[r, : n + m] = 1
        return Bucket(input_ids, labels, weights, attention_mask, [row[0] for row in rows])

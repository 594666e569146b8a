"""Evaluate the embedded model on held-out scenes (seeds disjoint from training).

    python -m vlmserve.embedded.evaluate                       # 500 scenes + 100 multi-tile
    python -m vlmserve.embedded.evaluate --model /tmp/run --num-scenes 100

Greedy decoding through transformers' Idefics3ForConditionalGeneration.generate, the
correctness reference. Caption: exact string match. Questions: exact answer match, per kind.
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import Idefics3ForConditionalGeneration

from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.embedded.data import CAPTION_PROMPT, sample_size
from vlmserve.embedded.processor import SceneProcessor
from vlmserve.embedded.scenes import (
    CANONICAL_SIZE,
    HELDOUT_SEED_BASE,
    QUESTION_KINDS,
    Scene,
    caption,
    generate_scene,
    heldout_questions,
    render_scene,
)

MULTI_TILE_SEED_OFFSET = 500_000  # multi-tile held-out scenes use seeds after the 48-px ones
TASKS = ("caption", *QUESTION_KINDS)


@dataclass
class Scores:
    """Correct / total per task ('caption' and each question kind), plus the failures."""

    correct: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    total: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failures: list[tuple[int, str, str, str]] = field(default_factory=list)  # seed, task, want, got

    def accuracy(self, task: str) -> float:
        return self.correct[task] / self.total[task] if self.total[task] else float("nan")


@dataclass(frozen=True)
class Query:
    seed: int
    task: str
    prompt: str
    expected: str
    image_index: int


def heldout_scenes(num_scenes: int, *, multi_tile: bool = False) -> list[Scene]:
    """Held-out scenes: 48-px single tiles, or random sizes/aspects (1-13 tiles)."""
    scenes = []
    for i in range(num_scenes):
        seed = HELDOUT_SEED_BASE + (MULTI_TILE_SEED_OFFSET if multi_tile else 0) + i
        width = height = CANONICAL_SIZE
        if multi_tile:
            width, height = sample_size(np.random.default_rng([seed, 3]), CANONICAL_SIZE, 12)
        scenes.append(generate_scene(seed, width=width, height=height))
    return scenes


def load(folder: str | Path) -> tuple[Idefics3ForConditionalGeneration, SceneProcessor]:
    model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), SceneProcessor.from_pretrained(folder)


@torch.inference_mode()
def generate_answers(
    model: Idefics3ForConditionalGeneration,
    processor: SceneProcessor,
    prompts: Sequence[str],
    images: Sequence[Image.Image],
    *,
    max_new_tokens: int = 40,
    batch_size: int = 64,
) -> list[str]:
    """Greedy answers to single-turn (image, prompt) user messages.

    Rows are batched only with rows of equal prompt length and tile count, so no padding
    enters the prompt and each answer equals the unbatched greedy answer.
    """
    encoded = [
        processor.encode(user_turn(p), [image]) for p, image in zip(prompts, images, strict=True)
    ]
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for row, enc in enumerate(encoded):
        groups[(len(enc.token_ids), enc.pixel_values[0].shape[0])].append(row)
    answers = [""] * len(prompts)
    for rows in groups.values():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            input_ids = torch.tensor([encoded[r].token_ids for r in chunk])
            # [rows, tiles, 3, S, S]: one image per row
            pixel_values = torch.stack([encoded[r].pixel_values[0] for r in chunk])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                pixel_values=pixel_values,
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
            for r, generated in zip(chunk, out[:, input_ids.shape[1] :], strict=True):
                answers[r] = processor.decode(generated)
    return answers


def user_turn(prompt: str) -> list[dict]:
    """A one-message conversation: an image (passed separately) and the prompt."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]


def evaluate(
    model: Idefics3ForConditionalGeneration, processor: SceneProcessor, scenes: Sequence[Scene]
) -> Scores:
    queries: list[Query] = []
    images = []
    for index, scene in enumerate(scenes):
        images.append(render_scene(scene))
        queries.append(Query(scene.seed, "caption", CAPTION_PROMPT, caption(scene), index))
        for pair in heldout_questions(scene):
            queries.append(Query(scene.seed, pair.kind, pair.question, pair.answer, index))
    answers = generate_answers(
        model, processor, [q.prompt for q in queries], [images[q.image_index] for q in queries]
    )
    scores = Scores()
    for query, answer in zip(queries, answers, strict=True):
        scores.total[query.task] += 1
        if answer == query.expected:
            scores.correct[query.task] += 1
        else:
            scores.failures.append((query.seed, query.task, query.expected, answer))
    return scores


def format_table(results: dict[str, Scores]) -> str:
    lines = ["| scenes | " + " | ".join(TASKS) + " |", "|---" * (len(TASKS) + 1) + "|"]
    for name, scores in results.items():
        cells = [
            f"{100 * scores.accuracy(t):.1f}% ({scores.correct[t]}/{scores.total[t]})"
            for t in TASKS
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--num-scenes", type=int, default=500)
    parser.add_argument("--multi-tile-scenes", type=int, default=100)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--show-failures", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, processor = load(args.model)
    results = {}
    if args.num_scenes:
        results[f"{args.num_scenes} x 48 px (1 tile)"] = evaluate(
            model, processor, heldout_scenes(args.num_scenes)
        )
    if args.multi_tile_scenes:
        results[f"{args.multi_tile_scenes} x varied size (1-13 tiles)"] = evaluate(
            model, processor, heldout_scenes(args.multi_tile_scenes, multi_tile=True)
        )
    print(format_table(results))
    for name, scores in results.items():
        for seed, task, expected, got in scores.failures[: args.show_failures]:
            print(f"  [{name}] seed {seed} {task}: expected {expected!r}, got {got!r}")


if __name__ == "__main__":
    main()

"""`vlmserve demo`: the main job on the default model.

Offline multimodal generation with the embedded model: generated scenes (written as real
PNG/JPEG files, several sizes from one tile to a panorama) go through the whole engine
(header-only token counts, the preprocessing pool, the encoder cache, vision tower, paged
KV, continuous batching), and each answer is printed beside the scene's ground truth. The
questions about one scene come after the captions, so its embeddings are cache hits.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from vlmserve.cli.engine_args import engine_config_from_args
from vlmserve.embedded.evaluate import CAPTION_PROMPT
from vlmserve.embedded.scenes import (
    HELDOUT_SEED_BASE,
    caption,
    generate_scene,
    heldout_questions,
    render_scene,
)
from vlmserve.engine.core import Engine
from vlmserve.engine.stats import render_engine_stats
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams

SIZES = [(48, 48), (96, 96), (320, 48)]  # one tile, a square grid, a panorama


def _scene_files(folder: Path) -> list[tuple[Path, object]]:
    files = []
    for i, (width, height) in enumerate(SIZES):
        scene = generate_scene(HELDOUT_SEED_BASE + 77 + i, width=width, height=height)
        path = folder / f"scene{i}.{'png' if i % 2 == 0 else 'jpg'}"
        render_scene(scene).save(path, quality=95)
        files.append((path, scene))
    return files


def _ask(path: Path, prompt: str, params: SamplingParams) -> Request:
    content = [{"type": "image", "image": str(path)}, {"type": "text", "text": prompt}]
    return Request(messages=[{"role": "user", "content": content}], sampling=params)


def run_demo(args: argparse.Namespace) -> int:
    engine = Engine(engine_config_from_args(args))
    params = SamplingParams(max_tokens=40, temperature=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        files = _scene_files(Path(tmp))
        asks = [(path, scene, CAPTION_PROMPT, caption(scene)) for path, scene in files]
        path, scene = files[1]
        asks += [(path, scene, qa.question, qa.answer) for qa in heldout_questions(scene)]
        start = time.perf_counter()
        # Two waves: the captions, then the questions about one of the images, whose
        # bytes the encoder cache then holds (its embeddings are hits, not tower calls).
        num_captions = len(files)
        outputs = engine.generate(
            [_ask(path, prompt, params) for path, _, prompt, _ in asks[:num_captions]]
        )
        outputs += engine.generate(
            [_ask(path, prompt, params) for path, _, prompt, _ in asks[num_captions:]]
        )
        elapsed = time.perf_counter() - start
    print(f"model: {args.model} ({engine.runner.model.family})\n")
    num_right = 0
    for (path, scene, prompt, truth), out in zip(asks, outputs, strict=True):
        answer = out.error or out.text.strip()
        num_right += answer == truth
        print(f"{path.name} {scene.width}x{scene.height}  Q: {prompt}")
        print(f"  A: {answer}   ({'right' if answer == truth else f'truth: {truth}'})")
        print(f"  [{out.num_prompt_tokens} prompt tokens, {out.num_image_tokens} from the image]")
    num_tokens = sum(len(o.token_ids) for o in outputs)
    steps = engine.num_steps
    print(f"\n{num_right}/{len(outputs)} answers right; {num_tokens} tokens in {elapsed:.2f}s, "
          f"{steps} engine steps")  # fmt: skip
    print(render_engine_stats(engine.stats()))
    return 0 if all(o.error is None for o in outputs) else 1

"""`vlmserve demo`: the main job on the default model.

Runs an offline multimodal generation: a few chat requests with generated images go
through the full engine (processor, vision tower, paged KV, continuous batching) at once.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vlmserve.engine import Engine
from vlmserve.engine_args import engine_config_from_args
from vlmserve.processing import Request
from vlmserve.sampling import SamplingParams


def _scene(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(150, 255, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x, y = int(rng.integers(0, width - 10)), int(rng.integers(0, height - 10))
        size = int(rng.integers(8, max(9, min(width, height) // 3)))
        colour = tuple(int(v) for v in rng.integers(0, 150, 3))
        draw.ellipse((x, y, x + size, y + size), fill=colour)
    return image


def default_model_path() -> Path:
    """A tiny random LLaVA-OneVision checkpoint built on first use (no weights can be
    downloaded here)."""
    from vlmserve.models.random_checkpoint import make_vlm_checkpoint

    path = Path(tempfile.gettempdir()) / "vlmserve-demo-llava-ov"
    if not (path / "config.json").is_file():
        make_vlm_checkpoint(path, "llava_onevision")
    return path


def run_demo(args: argparse.Namespace) -> int:
    path = Path(args.model) if args.model else default_model_path()
    args.model = str(path)
    engine = Engine(engine_config_from_args(args))
    questions = ["describe this image", "what colour is the circle", "where is the star"]
    sizes = [(96, 64), (64, 64), (40, 96)]
    requests = [
        Request(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": _scene(w, h, i)},
                        {"type": "text", "text": q},
                    ],
                }
            ],
            sampling=SamplingParams(max_tokens=24, temperature=0.0),
        )
        for i, (q, (w, h)) in enumerate(zip(questions, sizes, strict=True))
    ]
    start = time.perf_counter()
    outputs = engine.generate(requests)
    elapsed = time.perf_counter() - start
    print(f"model: {path} ({engine.runner.model.family})")
    for question, out in zip(questions, outputs, strict=True):
        print(f"Q: {question}\nA: {out.error or out.text}")
        print(f"   [{out.num_prompt_tokens} prompt tokens, {out.num_image_tokens} from the image]")
    num_tokens = sum(len(o.token_ids) for o in outputs)
    steps = engine.num_steps
    print(f"{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f}s, {steps} steps")
    return 0 if all(o.error is None for o in outputs) else 1

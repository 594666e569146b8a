"""Time to first token of a second question about the same image against the first.

A random LLaVA-OneVision checkpoint with real-sized tiles (384 px, 27x27 patches, 3x3
pinpoints) and a 2048x1536 JPEG. Three second questions, each in a fresh engine after one
warm-up request on another image:
  * same prefix, encoder cache on: prefix cache (image KV) + encoder cache;
  * text BEFORE the image (no shared prefix), encoder cache on: encoder cache alone
    (skips decode, tiling and the tower; the prefill still runs);
  * text before the image, encoder cache off: the baseline for the row above.
Medians over --repeat runs; the target is >= 5x lower TTFT for the second question.

    .venv/bin/python -m benchmarks.engine.encoder_cache
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time

import numpy as np
from PIL import Image

from benchmarks.lib.common import table, write_result
from encoders.config import EncoderConfig
from scheduler.config import CacheConfig, SchedulerConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (height // 16, width // 16, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def ask(image: bytes, text: str, image_first: bool = True) -> Request:
    parts = [{"type": "image", "image": image}, {"type": "text", "text": text}]
    content = parts if image_first else parts[::-1]
    return Request(messages=[{"role": "user", "content": content}],
                   sampling=SamplingParams(max_tokens=1, temperature=0.0))  # fmt: skip


def ttft(engine: Engine, request: Request) -> float:
    start = time.perf_counter()
    engine.add_request(request)
    while not any(out.new_token_ids for out in engine.step()):
        pass
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return elapsed


def measure(path: str, image: bytes, warm: bytes, image_first: bool, cache_bytes: int) -> tuple:
    engine = Engine(EngineConfig(
        ModelConfig(path), CacheConfig(num_blocks=4096, block_size=16),
        SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=8),
        encoder=EncoderConfig(num_workers=1, cache_bytes=cache_bytes),
    ))  # fmt: skip
    ttft(engine, ask(warm, "what is this", image_first))  # warm-up: pool, kernels
    first = ttft(engine, ask(image, "what colour is the star", image_first))
    second = ttft(engine, ask(image, "how many circles are there", image_first))
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_vlm_checkpoint(tmp, "llava_onevision", tile=384, patch=14))
        image, warm = jpeg(2048, 1536, 0), jpeg(1024, 768, 1)
        rows = []
        cases = [("same prefix, cache on", True, 256 << 20),
                 ("text first, cache on", False, 256 << 20),
                 ("text first, cache off", False, 0)]  # fmt: skip
        for name, image_first, cache_bytes in cases:
            runs = [
                measure(path, image, warm, image_first, cache_bytes) for _ in range(args.repeat)
            ]
            first = statistics.median(r[0] for r in runs)
            second = statistics.median(r[1] for r in runs)
            rows.append(dict(case=name, first_ttft_ms=1e3 * first, second_ttft_ms=1e3 * second,
                             ratio=first / second))  # fmt: skip
    print(table(rows, ["case", "first_ttft_ms", "second_ttft_ms", "ratio"]))
    print(f"wrote {write_result('encoder_cache', dict(repeat=args.repeat, rows=rows))}")


if __name__ == "__main__":
    main()

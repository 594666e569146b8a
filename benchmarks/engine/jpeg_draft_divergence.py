"""How often JPEG draft decoding changes a greedy answer, per model family.

Draft decoding (libjpeg's DCT-domain downscale by 2, 4 or 8 while the result still covers
every resample target) saves decode time but changes the pixels the tiles are resampled
from, so the tower sees different inputs from what transformers (and vLLM) feed it. Here:
tiny random Idefics3 and LLaVA-OneVision checkpoints and the embedded default model, N
requests each with a different real JPEG (a generated scene, at a size where draft engages:
at least a 2x downscale), 16-token greedy outputs with draft on and off. Reported: the
share of requests whose output differs; and, as the baseline in the same run, draft off
against the reference image processor (the HF processor, or SceneProcessor for the
embedded model), which must be 0%.

    .venv/bin/python -m benchmarks.engine.jpeg_draft_divergence [--num-requests 50]
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.lib.common import table, write_result
from encoders.config import EncoderConfig
from encoders.image_io import decode_rgb, read_header
from encoders.image_spec import ImageSpec
from scheduler.config import CacheConfig, SchedulerConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.embedded.evaluate import CAPTION_PROMPT
from vlmserve.embedded.scenes import generate_scene, render_scene
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

MAX_TOKENS = 16
# (width, height) ranges to draw from: at least twice every family's resample targets
# (random checkpoints: 96-px canvases; embedded: grids of up to 12 48-px tiles).
SIZE_RANGES = {
    "idefics3": ((200, 900), (200, 900)),
    "llava_onevision": ((200, 900), (200, 900)),
    "embedded": ((300, 1400), (120, 900)),
}


def engine(path: Path, **encoder: object) -> Engine:
    return Engine(
        EngineConfig(
            ModelConfig(str(path)),
            CacheConfig(num_blocks=1024, block_size=16),
            SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32),
            encoder=EncoderConfig(num_workers=0, cache_bytes=0, **encoder),
        )
    )


def draft_engages(data: bytes, spec: ImageSpec) -> bool:
    """True when a draft decode of `data` comes out at least 2x smaller on a side."""
    header = read_header(data)
    layout = spec.layout(header.width, header.height)
    image, _ = decode_rgb(data, spec.draft_size(layout))
    return image.width * 2 <= header.width


def jpegs(family: str, spec: ImageSpec, num: int, seed: int) -> list[bytes]:
    """`num` different scene JPEGs on which draft decoding engages."""
    rng = np.random.default_rng(seed)
    (w0, w1), (h0, h1) = SIZE_RANGES[family]
    out: list[bytes] = []
    while len(out) < num:
        width, height = int(rng.integers(w0, w1)), int(rng.integers(h0, h1))
        scene = generate_scene(int(rng.integers(1 << 30)), width=width, height=height)
        buffer = io.BytesIO()
        render_scene(scene).save(buffer, "JPEG", quality=int(rng.integers(75, 96)))
        if draft_engages(buffer.getvalue(), spec):
            out.append(buffer.getvalue())
    return out


def ask(image: bytes, prompt: str, ignore_eos: bool) -> Request:
    content = [{"type": "image", "image": image}, {"type": "text", "text": prompt}]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=ignore_eos)
    return Request(messages=[{"role": "user", "content": content}], sampling=params)


def outputs(path: Path, requests: list[Request], **encoder: object) -> list[list[int]]:
    results = engine(path, **encoder).generate(requests)
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    return [list(r.token_ids) for r in results]


def measure(family: str, path: Path, num: int, seed: int) -> dict:
    on = engine(path, jpeg_draft=True)
    spec = on.processor.image_spec
    assert spec is not None and spec.jpeg_draft
    images = jpegs(family, spec, num, seed)
    embedded = family == "embedded"
    prompt = CAPTION_PROMPT if embedded else "describe the image"
    # The random models never stop by themselves; the embedded one ends its answers.
    requests = [ask(data, prompt, ignore_eos=not embedded) for data in images]
    drafted = [list(r.token_ids) for r in on.generate(requests)]
    exact = outputs(path, requests, jpeg_draft=False)
    reference = outputs(path, requests, use_pool=False)  # HF / SceneProcessor images
    differ = sum(a != b for a, b in zip(drafted, exact, strict=True))
    differ_ref = sum(a != b for a, b in zip(exact, reference, strict=True))
    return {
        "family": family, "num_requests": num, "draft_vs_exact_differ": differ,
        "draft_vs_exact_pct": 100 * differ / num, "exact_vs_reference_differ": differ_ref,
        "exact_vs_reference_pct": 100 * differ_ref / num,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            "idefics3": make_vlm_checkpoint(Path(tmp) / "idefics3", "idefics3", kv_heads=4),
            "llava_onevision": make_vlm_checkpoint(Path(tmp) / "llava", "llava_onevision"),
            "embedded": DEFAULT_MODEL_DIR,
        }
        for i, (family, path) in enumerate(paths.items()):
            rows.append(measure(family, path, args.num_requests, args.seed + i))
            print(table(rows[-1:], list(rows[-1])), flush=True)
    columns = ["family", "num_requests", "draft_vs_exact_pct", "exact_vs_reference_pct"]
    print(f"\n{MAX_TOKENS}-token greedy outputs that differ (% of requests)")
    print(table(rows, columns))
    path = write_result(
        "jpeg_draft_divergence", {"max_tokens": MAX_TOKENS, "seed": args.seed, "rows": rows}
    )
    print(f"-> {path}")


if __name__ == "__main__":
    main()

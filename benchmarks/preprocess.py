"""Image preprocessing throughput: the transformers image processors (both backends)
against our pipeline (inline, and the worker pool with 1 and 2 processes), per family.

Generated files (fixed seed): JPEG / PNG / WebP photos from 640x480 to 4000x3000, 4:1
panoramas and tall PNG screenshots. Each contender takes the encoded bytes and produces
the tower's input tiles (the HF processors: decode + their __call__; ours: header,
draft decode, resize/tile, uint8 hand-off; normalisation happens later on the device).
Reports ms per image, ms per tile, images/s and CPU ms per image (all processes: the
workers' too; the HF processors on --hf-threads torch threads), and for ours the decode CPU per
image and the CPU per tile beyond it (resize/tile + hand-off, thread CPU time: a loaded
machine does not inflate it); median of --repeat runs.

    .venv/bin/python -m benchmarks.preprocess                  # 200 images
    .venv/bin/python -m benchmarks.preprocess --num-images 24  # a quick run
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from functools import partial

import numpy as np
from PIL import Image, ImageDraw, features

from benchmarks.common import table, write_result
from encoders.image_spec import ImageSpec
from encoders.preprocess import PreprocessPool
from vlmserve.info import pil_variant

SIZES = [(640, 480), (1024, 768), (1280, 960), (1920, 1080), (2048, 1536), (4000, 3000),
         (4000, 1000), (2400, 600), (1170, 2532), (750, 1334)]  # fmt: skip


def make_files(num_images: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    files = []
    for i in range(num_images):
        width, height = SIZES[i % len(SIZES)]
        y, x = np.mgrid[0:height:4, 0:width:4]  # a smooth card, upsampled: photo-like
        small = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
        image = Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x0, y0 = int(rng.integers(0, width - 40)), int(rng.integers(0, height - 40))
            draw.ellipse((x0, y0, x0 + 40 + int(rng.integers(0, width // 4)),
                          y0 + 40 + int(rng.integers(0, height // 4))),
                         fill=tuple(int(c) for c in rng.integers(0, 255, 3)))  # fmt: skip
        screenshot = height > width
        fmt = "PNG" if screenshot else ("JPEG", "JPEG", "WEBP")[i % 3]
        buffer = io.BytesIO()
        image.save(buffer, fmt, **({"quality": 90} if fmt != "PNG" else {}))
        files.append(buffer.getvalue())
    return files


def specs() -> dict[str, tuple[ImageSpec, list]]:
    from transformers import Idefics3ImageProcessor, LlavaOnevisionImageProcessor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    llava = LlavaOnevisionImageProcessor()  # 384-px tiles, 6x6 pinpoints (the real ones)
    idefics = Idefics3ImageProcessor()  # 364-px tiles, longest edge 1456
    return {
        "llava_onevision": (
            ImageSpec(
                "llava_onevision",
                384,
                int(llava.resample),
                tuple(llava.image_mean),
                tuple(llava.image_std),
                grid_pinpoints=tuple(map(tuple, llava.image_grid_pinpoints)),
                num_patches=729,
                max_num_patches=9,
            ),  # fmt: skip
            [("hf torchvision", llava), ("hf pil", LlavaOnevisionImageProcessorPil())],
        ),
        "idefics3": (
            ImageSpec(
                "idefics3",
                364,
                int(idefics.resample),
                tuple(idefics.image_mean),
                tuple(idefics.image_std),
                longest_edge=1456,
                image_seq_len=169,
            ),  # fmt: skip
            [("hf torchvision", idefics), ("hf pil", Idefics3ImageProcessorPil())],
        ),
    }


def run_hf(processor: object, family: str, files: list[bytes]) -> tuple[float, float, int]:
    """(wall s, cpu s, tiles): decode with PIL then the processor, one image at a time."""
    wall, cpu, tiles = time.perf_counter(), time.process_time(), 0
    for data in files:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        batch = [[image]] if family == "idefics3" else image
        out = processor(batch, return_tensors="pt")
        tiles += int(out["pixel_values"].shape[1])
    return time.perf_counter() - wall, time.process_time() - cpu, tiles


def hf_run(processor: object, family: str, files: list[bytes], threads: int) -> dict:
    """On `threads` torch threads (0: torch's default). One gives per-core figures; more
    add the CPU that waiting intra-op threads burn, a lot on a loaded machine."""
    import torch

    default = torch.get_num_threads()
    torch.set_num_threads(threads or default)
    try:
        return dict(zip(("wall", "cpu", "tiles"), run_hf(processor, family, files), strict=True))
    finally:
        torch.set_num_threads(default)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_ours(pool: PreprocessPool, spec: ImageSpec, files: list[bytes]) -> dict:
    pids = [w.process.pid for w in pool.workers]
    before = [process_cpu_s(pid) for pid in pids]
    wall, cpu = time.perf_counter(), time.process_time()
    futures = [pool.submit(data, spec, False, 10**9) for data in files]
    results = [f.result() for f in futures]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu  # the parent's share
    after = [process_cpu_s(pid) for pid in pids]
    timings = [r.timings for r in results]
    if None in before + after:  # no /proc: the stages' own CPU time
        cpu = sum(t.decode_cpu_s + t.resize_cpu_s + t.handoff_cpu_s for t in timings)
    else:
        cpu += sum(a - b for a, b in zip(after, before, strict=True))
    return dict(wall=wall, cpu=cpu, tiles=sum(int(r.tiles.shape[0]) for r in results),
                decode=sum(t.decode_cpu_s for t in timings),
                resize=sum(t.resize_cpu_s + t.handoff_cpu_s for t in timings))  # fmt: skip


def median_of(fn, repeat: int) -> dict:
    runs = [fn() for _ in range(repeat)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--families", default="llava_onevision,idefics3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-threads", type=int, default=1,
                        help="torch threads of the HF processors (0: torch's default)")  # fmt: skip
    args = parser.parse_args()
    files = make_files(args.num_images, args.seed)
    pil = pil_variant()
    pil_text = f"{pil['variant']} {Image.__version__} (libjpeg-turbo {features.version('jpg')})"
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows, n = [], len(files)
    pools = {w: PreprocessPool(w, max_pending=64) for w in (0, 1, 2)}
    for family in args.families.split(","):
        spec, hf = specs()[family]
        contenders = [(name, partial(hf_run, p, family, files, args.hf_threads))
                      for name, p in hf]  # fmt: skip
        for w in (0, 1, 2):
            name = f"ours, {w} worker{'s' if w != 1 else ''}" if w else "ours, inline"
            contenders.append((name, partial(run_ours, pools[w], spec, files)))
        family_rows = []
        for name, fn in contenders:
            fn() if name.startswith("ours") else None  # warm-up (pool start, imports)
            r = median_of(fn, args.repeat)
            family_rows.append(dict(
                family=family, contender=name, ms_per_image=1e3 * r["wall"] / n,
                ms_per_tile=1e3 * r["wall"] / r["tiles"], images_per_s=n / r["wall"],
                cpu_ms_per_image=1e3 * r["cpu"] / n, tiles=int(r["tiles"]),
                decode_cpu_ms_per_image=1e3 * r["decode"] / n if "decode" in r else None,
                resize_cpu_ms_per_tile=1e3 * r["resize"] / r["tiles"] if "resize" in r else None,
            ))  # fmt: skip
        base = family_rows[0]["cpu_ms_per_image"]
        for row in family_rows:
            row["per_core_speedup_vs_hf_torchvision"] = base / row["cpu_ms_per_image"]
        rows += family_rows
    for pool in pools.values():
        pool.close()
    columns = ["family", "contender", "ms_per_image", "ms_per_tile", "images_per_s",
               "cpu_ms_per_image", "per_core_speedup_vs_hf_torchvision",
               "decode_cpu_ms_per_image", "resize_cpu_ms_per_tile"]  # fmt: skip
    print(f"{n} images, {pil_text}; SIMD: {pil['simd']}; 1-min load average at start: "
          f"{load_avg} on {os.cpu_count()} CPUs")  # fmt: skip
    print(table(rows, columns))
    path = write_result("preprocess", dict(num_images=n, pil=pil_text, repeat=args.repeat,
                                           pillow_simd=pil["simd"], load_avg_1m=load_avg,
                                           hf_threads=args.hf_threads, rows=rows))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

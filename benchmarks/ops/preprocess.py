"""Image preprocessing throughput: the transformers image processors (both backends)
against our pipeline (inline, and the worker pool with 1 and 2 processes), per family;
where pillow-simd is installed, our pool on stock pillow too (a subprocess).

Generated files (fixed seed): JPEG / PNG / WebP photos from 640x480 to 4000x3000, 4:1
panoramas and tall PNG screenshots. Each contender takes the encoded bytes and produces
the tower's input tiles (the HF processors: decode + their __call__; ours: header,
draft decode, resize/tile, uint8 hand-off; normalisation happens later on the device).
Reports ms per image, ms per tile, images/s and CPU ms per image (all processes: the
workers' too; the HF processors on --hf-threads torch threads), and for ours the decode CPU per
image and the CPU per tile beyond it (resize/tile + hand-off, thread CPU time: a loaded
machine does not inflate it). Medians of --repeat rounds, each round running every
contender once (a slow spell of a shared machine hits all of them); the speed-up's
spread over the rounds is reported beside it.

    .venv/bin/python -m benchmarks.ops.preprocess                  # 200 images
    .venv/bin/python -m benchmarks.ops.preprocess --num-images 24  # a quick run
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, features

from benchmarks.lib.common import table, write_result
from encoders.image_spec import ImageSpec
from encoders.preprocess import PreprocessPool
from vlmserve.cli.info import dist_version, pil_variant

ROOT = Path(__file__).resolve().parents[2]
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
    """Keep the pool full (up to its bound) and take the results in order, dropping each
    image's tiles once counted, as the HF loop drops its outputs."""
    pids = [w.process.pid for w in pool.workers]
    before = [process_cpu_s(pid) for pid in pids]
    wall, cpu = time.perf_counter(), time.process_time()
    pending: deque = deque()
    tiles, timings = [], []

    def take() -> None:
        result = pending.popleft().result()
        tiles.append(int(result.tiles.shape[0]))
        timings.append(result.timings)

    for data in files:
        pending.append(pool.submit(data, spec, False, 10**9))
        while pending and (len(pending) >= pool.max_pending or pending[0].done()):
            take()
    while pending:
        take()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu  # the parent's share
    after = [process_cpu_s(pid) for pid in pids]
    if None in before + after:  # no /proc: the stages' own CPU time
        cpu = sum(t.decode_cpu_s + t.resize_cpu_s + t.handoff_cpu_s for t in timings)
    else:
        cpu += sum(a - b for a, b in zip(after, before, strict=True))
    return dict(wall=wall, cpu=cpu, tiles=sum(tiles),
                decode=sum(t.decode_cpu_s for t in timings),
                resize=sum(t.resize_cpu_s + t.handoff_cpu_s for t in timings))  # fmt: skip


def measure(contenders: list[tuple[str, Callable[[], dict]]], repeat: int) -> dict[str, dict]:
    """Per contender: the median of each figure over `repeat` rounds, plus the CPU time of
    every round ("cpu_rounds"). A round runs every contender once, so a slow spell of a
    shared machine lands on all of them rather than on one."""
    for name, fn in contenders:
        fn() if name.startswith("ours") else None  # warm-up (pool start, imports)
    runs: dict[str, list[dict]] = {name: [] for name, _ in contenders}
    for _ in range(repeat):
        for name, fn in contenders:
            runs[name].append(fn())
    return {name: {**{k: statistics.median(r[k] for r in rs) for k in rs[0]},
                   "cpu_rounds": [r["cpu"] for r in rs]}
            for name, rs in runs.items()}  # fmt: skip


def ours_contenders(pools: dict[int, PreprocessPool], spec: ImageSpec, files: list[bytes],
                    label: str = "ours") -> list[tuple[str, Callable[[], dict]]]:  # fmt: skip
    return [(f"{label}, {w} worker{'s' if w != 1 else ''}" if w else f"{label}, inline",
             partial(run_ours, pool, spec, files)) for w, pool in pools.items()]  # fmt: skip


def plain_pillow_runs(args: argparse.Namespace, family: str) -> dict[str, dict]:
    """Our pool on stock pillow (no SIMD), measured in a subprocess that imports PIL from
    `--plain-pillow` (pip-installed there on first use); empty where that fails. Its
    rounds run after the in-process ones, so their speed-up spread pairs rounds taken at
    different times."""
    target = Path(args.plain_pillow)
    if not (target / "PIL").is_dir():
        version = dist_version("pillow")
        spec = f"pillow=={version}" if version else "pillow"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        if subprocess.run([*pip, spec], check=False).returncode != 0:
            print(f"[preprocess] could not install {spec} into {target}: no stock-pillow rows")
            return {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target.resolve()), str(ROOT)])}
    command = [sys.executable, "-m", "benchmarks.ops.preprocess", "--ours-only",
               "--families", family,
               "--num-images", str(args.num_images), "--seed", str(args.seed),
               "--repeat", str(args.repeat)]  # fmt: skip
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        print(f"[preprocess] the stock-pillow run failed:\n{out.stderr[-2000:]}")
        return {}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--families", default="llava_onevision,idefics3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-threads",
        type=int,
        default=1,
        help="torch threads of the HF processors (0: torch's default)",
    )
    parser.add_argument(
        "--plain-pillow",
        default=str(ROOT / ".venv" / "plain-pillow"),
        help="stock pillow's folder for its rows (pip-installed on first use); '' skips them",
    )
    parser.add_argument(
        "--ours-only",
        action="store_true",
        help="internal: our pool only (1 and 2 workers), JSON on stdout",
    )
    args = parser.parse_args()
    files = make_files(args.num_images, args.seed)
    if args.ours_only:
        pools = {w: PreprocessPool(w, max_pending=64) for w in (1, 2)}
        spec = specs()[args.families][0]
        runs = measure(ours_contenders(pools, spec, files, "ours on stock pillow"), args.repeat)
        for pool in pools.values():
            pool.close()
        print(json.dumps(runs))
        return
    pil = pil_variant()
    pil_text = f"{pil['variant']} {Image.__version__} (libjpeg-turbo {features.version('jpg')})"
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows, n = [], len(files)
    pools = {w: PreprocessPool(w, max_pending=64) for w in (0, 1, 2)}
    for family in args.families.split(","):
        spec, hf = specs()[family]
        contenders = [(name, partial(hf_run, p, family, files, args.hf_threads))
                      for name, p in hf]  # fmt: skip
        runs = measure(contenders + ours_contenders(pools, spec, files), args.repeat)
        if args.plain_pillow and pil["variant"] == "pillow-simd":
            runs.update(plain_pillow_runs(args, family))
        base = runs["hf torchvision"]
        for name, r in runs.items():
            rounds = [b / c for b, c in zip(base["cpu_rounds"], r["cpu_rounds"], strict=True)]
            rows.append(dict(
                family=family, contender=name, ms_per_image=1e3 * r["wall"] / n,
                ms_per_tile=1e3 * r["wall"] / r["tiles"], images_per_s=n / r["wall"],
                cpu_ms_per_image=1e3 * r["cpu"] / n, tiles=int(r["tiles"]),
                per_core_speedup_vs_hf_torchvision=base["cpu"] / r["cpu"],
                speedup_low=min(rounds), speedup_high=max(rounds),
                decode_cpu_ms_per_image=1e3 * r["decode"] / n if "decode" in r else None,
                resize_cpu_ms_per_tile=1e3 * r["resize"] / r["tiles"] if "resize" in r else None,
            ))  # fmt: skip
    for pool in pools.values():
        pool.close()
    columns = ["family", "contender", "ms_per_image", "ms_per_tile", "images_per_s",
               "cpu_ms_per_image", "per_core_speedup_vs_hf_torchvision", "speedup_low",
               "speedup_high", "decode_cpu_ms_per_image", "resize_cpu_ms_per_tile"]  # fmt: skip
    print(f"{n} images, {pil_text}; SIMD: {pil['simd']}; 1-min load average at start: "
          f"{load_avg} on {os.cpu_count()} CPUs; medians of {args.repeat} rounds (speedup "
          f"low/high: the extreme rounds)")  # fmt: skip
    print(table(rows, columns))
    path = write_result("preprocess", dict(num_images=n, pil=pil_text, repeat=args.repeat,
                                           pillow_simd=pil["simd"], load_avg_1m=load_avg,
                                           hf_threads=args.hf_threads, rows=rows))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Vision work per image: vlmserve's fused SigLIP forward against the old one and
transformers', on `benchmarks/serving/vs_vllm.py`'s image workload.

The workload's LLaVA-OneVision-shaped random checkpoint (SigLIP tower at tile 384 /
patch 14, hidden 768, 12 heads, `--vision-layers` layers; the projector into the text
hidden size) and one of its 1024 x 768 JPEGs (1 + 2 x 3 = 7 tiles of 729 patches). Each
contender runs `encode` on the same tiles (tower, projector, anyres packing), in
interleaved rounds; medians of wall time and of process CPU time (all threads) per image.

- transformers: `LlavaOnevisionModel.get_image_features` (HF SiglipVisionModel, SDPA)
- timm (old): vlmserve's tower before this path (timm `Block.forward`, plain linears)
- fused: `encoders.siglip_fused` with plain linears (what runs on GPU / bf16)
- fused+packed: the same with oneDNN-packed linears, GELU and residual adds fused into
  them (the engine's CPU float32 default; tile by tile on 1 thread, all tiles at once on
  more)
- fused+packed, 1-tile chunks / all tiles at once: the other chunking

    .venv/bin/python -m benchmarks.ops.vision_tower           # ~3 minutes on 2 cores
    .venv/bin/python -m benchmarks.ops.vision_tower --quick   # 2 layers, 2 rounds
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.lib import vs_vllm_workloads as workload
from benchmarks.lib.common import environment, matmul_peak, table, write_result
from encoders.siglip_fused import default_tiles_per_chunk
from encoders.vision import VisionEncoder, VisionInput, vision_inputs_from_hf
from encoders.weights import load_tensors, read_config
from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

BASELINE, NEW = "timm (old)", "fused+packed"


def build_checkpoint(path: Path, vision_layers: int) -> Path:
    """The image workload's vision side (tower, grid, projector into the text workload's
    hidden size); a one-layer decoder, since only the vision side is timed here."""
    text = workload.text_args(quick=False)
    grid = workload.MAX_GRID
    return make_vlm_checkpoint(
        path, "llava_onevision", hidden=text.hidden, layers=1, heads=text.heads,
        kv_heads=text.kv_heads, vocab=256, tile=workload.TILE, patch=workload.PATCH,
        vision_hidden=workload.VISION_HIDDEN, vision_layers=vision_layers,
        vision_heads=workload.VISION_HEADS, vision_intermediate=workload.VISION_INTERMEDIATE,
        max_grid=grid, aspect_ratio=workload.ASPECT_RATIO,
    )  # fmt: skip


def image_batch(checkpoint: Path, folder: Path, num_images: int) -> dict:
    """The HF processor's output for `num_images` distinct workload JPEGs."""
    from PIL import Image
    from transformers import AutoImageProcessor

    images = []
    for i in range(num_images):
        path = folder / f"{i}.jpg"
        workload.synthetic_jpeg(path, seed=i)
        images.append(Image.open(path).convert("RGB"))
    return dict(AutoImageProcessor.from_pretrained(checkpoint)(images, return_tensors="pt"))


def contenders(checkpoint: Path, batch: dict) -> dict[str, Callable[[], list[torch.Tensor]]]:
    from transformers import LlavaOnevisionForConditionalGeneration

    config, tensors = read_config(checkpoint), load_tensors(checkpoint)
    inputs: list[VisionInput] = vision_inputs_from_hf("llava_onevision", batch)

    def encoder(fused: bool, packed: bool, tiles_per_chunk: int | None = None):
        model = VisionEncoder.from_checkpoint(config, tensors)
        model.tower.fused, model.tower.tiles_per_chunk = fused, tiles_per_chunk
        if packed:
            model.pack_weights()
        return lambda: model.encode(inputs)

    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(checkpoint).eval()
    num_tiles = sum(x.pixel_values.shape[0] for x in inputs)
    if default_tiles_per_chunk(torch.device("cpu"), num_tiles) == 1:
        other, other_chunk = "fused+packed, all tiles at once", num_tiles
    else:
        other, other_chunk = "fused+packed, 1-tile chunks", 1

    @torch.no_grad()
    def transformers_features() -> list[torch.Tensor]:
        out = hf.model.get_image_features(batch["pixel_values"], batch["image_sizes"])
        return list(out.pooler_output)

    return {
        "transformers": transformers_features,
        BASELINE: encoder(fused=False, packed=False),
        "fused": encoder(fused=True, packed=False),
        NEW: encoder(fused=True, packed=True),
        other: encoder(fused=True, packed=True, tiles_per_chunk=other_chunk),
    }


def busy_ticks() -> tuple[int, int]:
    """(CPU ticks the whole machine spent busy, ticks this process spent) so far (Linux)."""
    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq, steal = map(int, f.readline().split()[1:9])
    with open("/proc/self/stat") as f:
        utime, stime = map(int, f.read().rsplit(")", 1)[1].split()[11:13])
    return user + nice + system + irq + softirq + steal, utime + stime


def measure(fn: Callable[[], object]) -> dict[str, float]:
    """One call: wall and process CPU seconds, minor page faults, and the cores other
    processes kept busy meanwhile (what makes a timing on a shared machine noisy)."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    machine, ours = busy_ticks()
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    machine_after, ours_after = busy_ticks()
    others = (machine_after - machine - (ours_after - ours)) / os.sysconf("SC_CLK_TCK")
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
        "other_cores_busy": max(0.0, others / wall),
    }


def tower_gflop(tower_layers: int, num_tiles: int) -> float:
    """Forward FLOPs of the tower (patch embedding + blocks) over `num_tiles` tiles."""
    d, i = workload.VISION_HIDDEN, workload.VISION_INTERMEDIATE
    p = (workload.TILE // workload.PATCH) ** 2
    per_layer = 2 * p * (4 * d * d + 2 * d * i) + 4 * p * p * d  # GEMMs + attention
    embed = 2 * p * 3 * workload.PATCH**2 * d
    return num_tiles * (embed + tower_layers * per_layer) / 1e9


def summarise(samples: dict[str, list[dict]], outputs: dict, gflop: float, images: int) -> list:
    """One row per contender: medians per image, and the median of its per-round wall
    ratios to the old path (each round's contenders ran back to back, so a load change
    between rounds cancels out of the ratio)."""
    reference = outputs["transformers"]
    rows = []
    for name, runs in samples.items():
        wall = statistics.median(r["wall_s"] for r in runs) / images
        ratios = [b["wall_s"] / r["wall_s"] for b, r in zip(samples[BASELINE], runs, strict=True)]
        pairs = zip(outputs[name], reference, strict=True)
        rows.append({
            "path": name,
            "wall_ms_per_image": 1e3 * wall,
            "cpu_ms_per_image": 1e3 * statistics.median(r["cpu_s"] for r in runs) / images,
            "speedup_vs_old": statistics.median(ratios),
            "tower_gflop_per_s": gflop / images / wall,
            "page_faults_per_image": statistics.median(r["page_faults"] for r in runs) / images,
            "other_cores_busy": statistics.median(r["other_cores_busy"] for r in runs),
            "max_abs_diff_vs_transformers": max(float((o - e).abs().max()) for o, e in pairs),
        })  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    loadavg_start = os.getloadavg()
    print(f"[vision_tower] load average at the start: {_loadavg(loadavg_start)}")
    with tempfile.TemporaryDirectory(prefix="vision_tower_") as tmp:
        checkpoint = build_checkpoint(Path(tmp) / "model", args.vision_layers)
        batch = image_batch(checkpoint, Path(tmp), args.images)
        fns = contenders(checkpoint, batch)
    num_tiles = sum(len(x.pixel_values) for x in vision_inputs_from_hf("llava_onevision", batch))
    outputs = {name: fn() for name, fn in fns.items()}  # warm-up, and the numbers to compare
    samples: dict[str, list[dict]] = {name: [] for name in fns}
    for _ in range(args.rounds):  # interleaved: a load change hits every contender alike
        for name, fn in fns.items():
            samples[name].append(measure(fn))
    gflop = tower_gflop(args.vision_layers, num_tiles)
    return {
        "environment": environment(torch.device("cpu")),
        "vision_layers": args.vision_layers,
        "images": args.images,
        "tiles_per_image": num_tiles // args.images,
        "rounds": args.rounds,
        "tower_gflop_per_image": gflop / args.images,
        "fp32_matmul_peak_gflop_per_s": matmul_peak(torch.device("cpu"), torch.float32) / 1e9,
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
        "rows": summarise(samples, outputs, gflop, args.images),
        "samples": samples,
    }


def _loadavg(values: tuple[float, ...]) -> str:
    return " ".join(f"{x:.2f}" for x in values)


def report(result: dict) -> None:
    columns = [
        "path", "wall_ms_per_image", "cpu_ms_per_image", "speedup_vs_old", "tower_gflop_per_s",
        "page_faults_per_image", "other_cores_busy", "max_abs_diff_vs_transformers",
    ]  # fmt: skip
    print(
        f"\n{result['vision_layers']}-layer tower, {result['tiles_per_image']} tiles per image, "
        f"{result['environment']['threads']} threads, {result['rounds']} rounds "
        f"(medians; speedup: median of per-round wall ratios to {BASELINE!r})"
    )
    print(table(result["rows"], columns))
    print(
        f"tower: {result['tower_gflop_per_image']:.0f} GFLOP per image; float32 matmul peak "
        f"measured now: {result['fp32_matmul_peak_gflop_per_s']:.0f} GFLOP/s"
    )
    print(
        f"load average: start {_loadavg(result['loadavg_start'])}, "
        f"end {_loadavg(result['loadavg_end'])}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vision-layers", type=int, default=6, help="as vs_vllm's default")
    p.add_argument("--images", type=int, default=1, help="images per encode call")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--quick", action="store_true", help="2 layers, 2 rounds")
    p.add_argument("--name", default=None, help="result file (vision_tower / vision_tower_quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.vision_layers, args.rounds = 2, 2
    if min(args.vision_layers, args.images, args.rounds) < 1:
        p.error("--vision-layers, --images and --rounds must be >= 1")
    args.name = args.name or ("vision_tower_quick" if args.quick else "vision_tower")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    report(result)
    print(f"wrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()

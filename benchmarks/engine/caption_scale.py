"""The captioning job on one process vs on Ray Data (1 and 2 engine actors), in
interleaved rounds on this machine, and what that says about N nodes.

The workload: --images generated scenes (the embedded default model's held-out scenes,
48-px single-tile PNGs) captioned greedily (--max-tokens 40; the captions end at EOS after
5-25 tokens). Every engine gets one CPU: one torch thread, images decoded on its prepare
threads (`--preprocess-workers 0`, an actor's default). One thread is also what this
shared machine allows: with 2 torch threads under other helpers' load a step took 30-100x
longer (the OpenMP threads wait on each other). Three modes, the order rotating per round:

    single  `run_caption` on one Engine in this process: the single-process job
    ray1    `run_caption_ray`, 1 engine actor (1 CPU)
    ray2    `run_caption_ray`, 2 engine actors (1 CPU each)

All modes keep --max-in-flight requests in each engine; Ray hands an actor --batch-size
items per call. A local Ray cluster (3 logical CPUs, a 200 MB object store, no dashboard)
is started once and reused; each Ray run starts its own actors, as a job does. A thread
polls the output file, so every mode is timed on the lines that reach the disk:

    startup_s    from the call until the first line (engine or actors built, first batch)
    steady/s     lines per second after the first quarter of them are on disk
    e2e/s        images per second over the whole run, startup included

and the Ray overhead per image = 1 / steady(ray1) - 1 / steady(single) (the same threads,
the pipeline's read map, object store, batching and the engine draining at each batch's
end). The driver's own CPU per image (it parses and appends every line) bounds how far
one driver scales. Captions must agree across the modes (the run stops if not).

    .venv/bin/python -m benchmarks.engine.caption_scale             # ~8 minutes here
    .venv/bin/python -m benchmarks.engine.caption_scale --quick     # 96 images, one round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.lib.common import environment, table, write_result
from encoders.config import EncoderConfig
from vlmserve.cli.caption import CaptionSummary, discover, run_caption
from vlmserve.cli.caption_ray import RayConfig, ray_init_kwargs, run_caption_ray
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.embedded import DEFAULT_MODEL_DIR
from vlmserve.engine.core import Engine
from vlmserve.sample.params import SamplingParams

MODES = ("single", "ray1", "ray2")
RAY_POOLS = {"ray1": 1, "ray2": 2}  # engine actors, one CPU each
NODES = (1, 2, 4, 8, 16, 64)


class LinePoller:
    """(seconds since start, lines on disk) every `interval` s, on a thread."""

    def __init__(self, path: Path, interval: float = 0.05) -> None:
        self.path, self.interval = path, interval
        self.samples: list[tuple[float, int, float]] = []  # (s, lines, process CPU s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LinePoller:
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        lines = self.path.read_bytes().count(b"\n") if self.path.exists() else 0
        if not self.samples or lines != self.samples[-1][1]:
            self.samples.append((time.perf_counter() - self.start, lines, time.process_time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def first(self, lines: int) -> tuple[float, float]:
        """(when, this process's CPU seconds then) at least `lines` were on disk."""
        return next((t, cpu) for t, n, cpu in self.samples if n >= lines)


def timed(path: Path, job: Callable[[], CaptionSummary], num_images: int) -> dict:
    with LinePoller(path) as poller:
        summary = job()
    total = time.perf_counter() - poller.start
    assert summary.num_captioned == num_images, summary.render()
    quarter = max(1, num_images // 4)
    (t_quarter, cpu_quarter), (t_end, cpu_end) = poller.first(quarter), poller.first(num_images)
    return {
        "startup_s": poller.first(1)[0],
        "steady_per_s": (num_images - quarter) / max(t_end - t_quarter, 1e-9),
        "e2e_per_s": num_images / total,
        "wall_s": total,
        # This process in the steady window: for Ray the driver (receiving, parsing and
        # appending lines), for single the whole job.
        "driver_cpu_ms_per_image": 1e3 * (cpu_end - cpu_quarter) / (num_images - quarter),
    }


def run_mode(mode: str, folder: Path, out: Path, args: argparse.Namespace) -> dict:
    items = discover(folder, "Describe the image.")
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    config = EngineConfig(ModelConfig(str(DEFAULT_MODEL_DIR)), encoder=EncoderConfig(num_workers=0))
    common = {"max_in_flight": args.max_in_flight, "progress": False}
    if mode == "single":
        return timed(out, lambda: run_caption(Engine(config), items, out, sampling, **common),
                     len(items))  # fmt: skip
    actors = RAY_POOLS[mode]
    ray_config = RayConfig(min_actors=actors, max_actors=actors, batch_size=args.batch_size)
    job = lambda: run_caption_ray(config, items, out, sampling, ray_config, **common)
    return timed(out, job, len(items))


def captions(path: Path) -> dict[str, str]:
    return {r["id"]: r["caption"] for r in map(json.loads, path.read_text().splitlines())}


def project(median: dict[str, dict]) -> list[dict]:
    """Images/s on N nodes like this one (2 actors each), the one driver as the bound."""
    per_node = median["ray2"]["steady_per_s"]
    driver_limit = 1e3 / median["ray2"]["driver_cpu_ms_per_image"]
    rows = []
    for nodes in NODES:
        rate = min(nodes * per_node, driver_limit)
        rows.append({
            "nodes": nodes, "actors": 2 * nodes, "images_per_s": rate,
            "bound": "driver" if rate == driver_limit else "actors",
            "hours_per_1M_images": 1e6 / rate / 3600,
        })  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=int, default=960)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--max-in-flight", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32, help="items per Ray actor call")
    p.add_argument("--quick", action="store_true", help="96 images, one round")
    p.add_argument("--name", default="caption_scale")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.rounds, args.batch_size = 96, 1, 16
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the single-process engine's one CPU (module docstring)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from vlmserve.embedded.evaluate import heldout_scenes
    from vlmserve.embedded.scenes import render_scene

    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "scenes"
        folder.mkdir()
        for i, scene in enumerate(heldout_scenes(args.images)):
            render_scene(scene).save(folder / f"s{i:05d}.png")
        # Warm-up: the C++ kernels built and the model's files in the page cache.
        run_mode("single", folder, Path(tmp) / "warmup.jsonl", argparse.Namespace(**{
            **vars(args), "max_tokens": 4}))  # fmt: skip
        start = time.perf_counter()
        ray.init(**ray_init_kwargs(RayConfig(max_actors=2, object_store_mb=200)))
        cluster_start_s = time.perf_counter() - start
        reference = None
        try:
            for r in range(args.rounds):
                for mode in MODES[r % 3 :] + MODES[: r % 3]:
                    out = Path(tmp) / f"{mode}-{r}.jsonl"
                    runs[mode].append(run_mode(mode, folder, out, args))
                    reference = reference or captions(out)
                    if captions(out) != reference:
                        raise SystemExit(f"{mode} round {r + 1}: captions differ from round 1's")
                    print(f"  round {r + 1} {mode}: " + ", ".join(
                        f"{k} {v:.3g}" for k, v in runs[mode][-1].items()))  # fmt: skip
        finally:
            ray.shutdown()
    load_after = os.getloadavg()
    median = {m: {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in MODES}
    single, ray1, ray2 = (median[m] for m in MODES)
    overhead_ms = 1e3 * (1 / ray1["steady_per_s"] - 1 / single["steady_per_s"])
    rows = [{"mode": m, **median[m]} for m in MODES]
    print(table(rows, ["mode", "startup_s", "steady_per_s", "e2e_per_s", "wall_s",
                       "driver_cpu_ms_per_image"]))  # fmt: skip
    print(f"Ray cluster start: {cluster_start_s:.1f} s (once per job with --ray, local)")
    print(f"ray1 / single (steady): {ray1['steady_per_s'] / single['steady_per_s']:.2f}x; "
          f"ray2 / ray1: {ray2['steady_per_s'] / ray1['steady_per_s']:.2f}x")  # fmt: skip
    print(f"Ray overhead per image: {overhead_ms:.1f} ms (1/ray1 - 1/single, steady)")
    scaling = project(median)
    print(table(scaling, ["nodes", "actors", "images_per_s", "bound", "hours_per_1M_images"]))
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    result = {
        "workload": {k: getattr(args, k) for k in ("images", "rounds", "max_tokens",
                     "max_in_flight", "batch_size")},
        "environment": {**environment(torch.device("cpu")), "ray": ray.__version__,
                        "cpus": os.cpu_count()},
        "load_average_before": load_before,
        "load_average_after": load_after,
        "cluster_start_s": cluster_start_s,
        "median": median,
        "ray1_vs_single": ray1["steady_per_s"] / single["steady_per_s"],
        "ray2_vs_ray1": ray2["steady_per_s"] / ray1["steady_per_s"],
        "ray_overhead_ms_per_image": overhead_ms,
        "projection": scaling,
        "runs": runs,
    }  # fmt: skip
    print(f"wrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()

"""`vlmserve caption --ray [ADDRESS]`: the captioning job as a Ray Data pipeline.

The same job as `vlmserve.cli.caption` (same inputs, output lines, per-item errors and
resume), spread over a Ray cluster:

    items not yet done ─► map: read the bytes, check the header (Ray tasks, any node)
        ─► map_batches: an actor pool (ActorPoolStrategy(min, max)), one Engine per actor;
           each batch goes through `caption_stream` on that engine, so templating,
           tokenising, decode and tiling (the engine's preprocessing pool) run on the
           actor's node, next to the engine that uses them
        ─► the driver: streams the records out and appends them with `JsonlSink`

The sink is the driver, not a Ray `Datasink`: a datasink writes from remote tasks into
files of its own, while resume needs one JSONL where a line is on disk exactly when its
item is done. A record reaches the driver when its whole batch is done, so a kill loses
at most the batches in flight; their items run again on the rerun, and the sink drops a
record whose id is already written (a task Ray retried).

On a cluster of several nodes every node reads the inputs and loads the model itself: the
folder or JSONL's paths must be on a filesystem they share (or be URLs), and `--model` a
path each node has (the default model ships inside the package).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmserve.cli.caption import (
    CaptionItem,
    CaptionSummary,
    caption_stream,
    error_record,
    load_image_bytes,
    timed_prepare,
    todo_items,
    write_records,
)
from vlmserve.cli.caption_json import json_checked
from vlmserve.config import EngineConfig
from vlmserve.engine.outputs import PreparedRequest
from vlmserve.sample.params import SamplingParams

LOCAL = "local"  # `--ray` without an address: start a cluster on this machine for the run


@dataclass(frozen=True)
class RayConfig:
    """Where the job runs and how wide: the cluster, the engine actor pool, its batches."""

    address: str = LOCAL  # a running cluster's address ("auto", "HEAD_IP:6379")
    min_actors: int = 1
    max_actors: int | None = None  # None: as many as the cluster's CPUs hold
    cpus_per_actor: float = 1.0  # Ray's accounting; also the actor's torch threads
    batch_size: int = 64  # items per actor call (lines reach the disk a batch at a time)
    object_store_mb: int = 512  # a local cluster's object store (images in flight only)

    def __post_init__(self) -> None:
        if self.min_actors < 1:
            raise ValueError(f"min_actors={self.min_actors} must be >= 1")
        if self.max_actors is not None and self.max_actors < self.min_actors:
            raise ValueError(f"max_actors={self.max_actors} must be >= min_actors")
        if self.cpus_per_actor <= 0:
            raise ValueError(f"cpus_per_actor={self.cpus_per_actor} must be > 0")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.object_store_mb < 80:  # Ray refuses a store under about 75 MiB
            raise ValueError(f"object_store_mb={self.object_store_mb} must be >= 80")


# The read map's share of a CPU: it only reads files and parses headers, and a fraction
# lets it run beside actors that hold every whole CPU.
READ_CPUS = 0.25


def parse_actors(text: str) -> tuple[int, int | None]:
    """`--ray-actors`: "N" (a fixed pool) or "MIN,MAX" (Ray Data autoscales between)."""
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 1 or parts[0] > parts[-1]:
        raise ValueError(f"--ray-actors {text!r}: want N or MIN,MAX with 1 <= MIN <= MAX")
    return parts[0], parts[-1]


def ray_init_kwargs(config: RayConfig) -> dict[str, Any]:
    """`ray.init` arguments: connect to `config.address`, or start a local cluster sized so
    that the largest actor pool and the read map fit in Ray's CPU accounting."""
    common = {"logging_level": "WARNING", "include_dashboard": False}
    if config.address != LOCAL:
        return {"address": config.address, **common}
    cpus = os.cpu_count() or 1
    if config.max_actors is not None:
        cpus = max(cpus, math.ceil(config.max_actors * config.cpus_per_actor + READ_CPUS))
    return {
        "address": LOCAL,  # never a RAY_ADDRESS from the environment
        "num_cpus": cpus,
        "object_store_memory": config.object_store_mb << 20,
        **common,
    }


def pool_size(config: RayConfig, cluster_cpus: float) -> tuple[int, int]:
    """(min, max) engine actors: `max_actors`, or as many as the cluster's CPUs hold once
    the read map has its share."""
    if config.max_actors is not None:
        return config.min_actors, config.max_actors
    fits = int((cluster_cpus - READ_CPUS) // config.cpus_per_actor)
    return config.min_actors, max(config.min_actors, fits)


def read_row(row: dict[str, Any], max_pixels: int) -> dict[str, Any]:
    """The read map (a Ray task): the image's bytes, or the error that item gets. Empty
    strings, never None, keep every block's Arrow schema the same."""
    item = CaptionItem(row["id"], row["source"], row["prompt"])
    start = time.perf_counter()
    try:
        data, error, error_type = load_image_bytes(item, max_pixels), "", ""
    except (ValueError, OSError) as e:
        data, error, error_type = b"", str(e), type(e).__name__
    read_s = time.perf_counter() - start
    return {**row, "data": data, "read_s": read_s, "error": error, "error_type": error_type}


class CaptionActor:
    """One engine on a Ray worker; each call captions a batch of read rows through the
    single-process job's loop and returns their records as JSON lines."""

    def __init__(
        self, config: EngineConfig, sampling: SamplingParams, max_in_flight: int,
        num_workers: int, cpus: float,
    ) -> None:  # fmt: skip
        import torch

        from vlmserve.engine.core import Engine

        threads = max(1, int(cpus))
        torch.set_num_threads(threads)  # Ray's accounting, not the node's core count
        if config.encoder.num_workers is None:
            # Decode on the prepare threads, in this process: Ray's workers are the unit of
            # CPU parallelism, and a process pool nested in an actor dies with it, noisily
            # (`--preprocess-workers N` still asks for one).
            encoder = dataclasses.replace(config.encoder, num_workers=0)
            config = dataclasses.replace(config, encoder=encoder)
        self.engine = Engine(config)
        self.sampling, self.max_in_flight = sampling, max_in_flight
        self.pool = ThreadPoolExecutor(num_workers, thread_name_prefix="caption-prepare")

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        records, todo, read = [], [], {}
        columns = ("id", "source", "prompt", "data", "read_s", "error", "error_type")
        for item_id, source, prompt, data, read_s, error, error_type in zip(
            *(batch[c] for c in columns), strict=True
        ):
            item = CaptionItem(str(item_id), str(source), str(prompt))
            if error:
                records.append(error_record(item, str(error), str(error_type)))
            else:
                todo.append(item)
                read[item.item_id] = (bytes(data), float(read_s))

        def prepare(item: CaptionItem) -> tuple[PreparedRequest, float]:
            data, read_s = read.pop(item.item_id)
            prepared, prepare_s = timed_prepare(self.engine, item, self.sampling, data)
            return prepared, read_s + prepare_s

        records.extend(
            caption_stream(self.engine, todo, prepare, self.pool, {}, self.max_in_flight)
        )
        return {"record": [json.dumps(r) for r in records]}

    def __del__(self) -> None:  # Ray Data calls it when the pool shuts down gracefully
        if pool := getattr(self, "pool", None):
            pool.shutdown(wait=False, cancel_futures=True)


def run_caption_ray(
    config: EngineConfig,
    items: list[CaptionItem],
    output: Path,
    sampling: SamplingParams,
    ray_config: RayConfig,
    *,
    max_in_flight: int = 32,
    num_workers: int = 4,
    limit: int | None = None,
    retry_errors: bool = False,
    progress: bool = True,
) -> CaptionSummary:
    """Caption `items` not yet in `output` on a Ray cluster, appending a line per item.
    Connects (or starts a local cluster) unless this process is already connected, and
    then leaves the connection as it found it."""
    import ray

    start = time.perf_counter()
    todo, summary, done = todo_items(items, output, limit, retry_errors)
    connected = ray.is_initialized()
    try:
        if todo:
            if not connected:
                ray.init(**ray_init_kwargs(ray_config))
            records = _pipeline(config, todo, sampling, ray_config, max_in_flight, num_workers)
            records = json_checked(records, sampling)
            write_records(records, output, summary, done, len(todo), progress)
    except KeyboardInterrupt:  # lines written are whole; the batches in flight rerun
        summary.interrupted = True
    finally:
        if not connected and ray.is_initialized():
            ray.shutdown()
    summary.elapsed_s = time.perf_counter() - start
    return summary


def _pipeline(
    config: EngineConfig, todo: list[CaptionItem], sampling: SamplingParams,
    ray_config: RayConfig, max_in_flight: int, num_workers: int,
) -> Iterator[dict]:  # fmt: skip
    import ray
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the job's own bar counts lines on disk
    context.print_on_execution_start = False
    min_actors, max_actors = pool_size(ray_config, ray.cluster_resources().get("CPU", 1.0))
    rows = [{"id": i.item_id, "source": i.source, "prompt": i.prompt} for i in todo]
    num_blocks = max(1, math.ceil(len(rows) / ray_config.batch_size))
    dataset = (
        ray.data.from_items(rows, override_num_blocks=num_blocks)
        .map(read_row, fn_kwargs={"max_pixels": config.encoder.max_pixels}, num_cpus=READ_CPUS)
        .map_batches(
            CaptionActor,
            fn_constructor_kwargs={
                "config": config,
                "sampling": sampling,
                "max_in_flight": max_in_flight,
                "num_workers": num_workers,
                "cpus": ray_config.cpus_per_actor,
            },  # fmt: skip
            compute=ray.data.ActorPoolStrategy(min_size=min_actors, max_size=max_actors),
            batch_size=ray_config.batch_size,
            batch_format="numpy",
            num_cpus=ray_config.cpus_per_actor,
        )
    )
    for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
        for line in batch["record"]:
            yield json.loads(line)


# --- CLI ------------------------------------------------------------------------------


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """The `--ray*` flags of `vlmserve caption`."""
    group = parser.add_argument_group("Ray (pip install -e '.[ray]')")
    group.add_argument(
        "--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
        help="run on Ray Data: on a cluster started here for the run, or on the running "
        "cluster at ADDRESS ('auto' or HEAD_IP:6379; run it on one of the cluster's nodes)",
    )  # fmt: skip
    group.add_argument(
        "--ray-actors", default=None, metavar="MIN[,MAX]",
        help="engine actors: N, or MIN,MAX to autoscale (default: 1 to as many as the "
        "cluster's CPUs hold)",
    )  # fmt: skip
    group.add_argument(
        "--ray-cpus-per-actor", type=float, default=1.0, metavar="N",
        help="CPUs each engine actor holds, and its torch threads (default: 1)",
    )  # fmt: skip
    group.add_argument(
        "--ray-batch-size", type=int, default=None, metavar="N",
        help="items per actor call (default: 2 x --max-in-flight)",
    )  # fmt: skip
    group.add_argument(
        "--ray-object-store-mb", type=int, default=512, metavar="MB",
        help="object store of a cluster started here (default: 512)",
    )  # fmt: skip


def ray_config_from_args(args: argparse.Namespace) -> RayConfig:
    """The RayConfig the `--ray*` flags describe. Raises ValueError naming the flag."""
    min_actors, max_actors = (1, None) if args.ray_actors is None else parse_actors(args.ray_actors)
    try:
        return RayConfig(
            address=args.ray, min_actors=min_actors, max_actors=max_actors,
            cpus_per_actor=args.ray_cpus_per_actor,
            batch_size=args.ray_batch_size or 2 * args.max_in_flight,
            object_store_mb=args.ray_object_store_mb,
        )  # fmt: skip
    except ValueError as e:
        raise ValueError(f"--ray-*: {e}") from e

"""A tensor-parallel rank other than 0: its own process, its shard of the decoder and of
the KV cache, and a loop that runs whatever rank 0 sends.

Rank 0 (the engine's process) schedules, samples and detokenises; a worker only runs
forwards (its heads, its MLP rows, the two all-reduces per layer) and its share of the
vision tower's tiles. It holds no request state: each step's inputs arrive
self-contained (`StepInputs`), so a worker is the runner's `run` and nothing else.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch

from vlmserve.config import EngineConfig
from vlmserve.worker.parallel.comm import TPGroup, worker_store
from vlmserve.worker.runner import ModelRunner, StepInputs

log = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(size: int) -> int:
    """Intra-op threads of each rank on a CPU: the cores split evenly, at least one."""
    return max(1, usable_cores() // size)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` as rank `rank` runs it: on a GPU, device cuda:rank."""
    device = torch.device(config.model.device)
    if device.type != "cuda":
        return config
    model = dataclasses.replace(config.model, device=f"cuda:{rank}")
    return dataclasses.replace(config, model=model)


def worker_main(config: EngineConfig, rank: int, port: int, parent_pid: int) -> None:
    """The process target of ranks 1..n-1 (spawned by `executor.TensorParallelRunner`)."""
    logging.basicConfig(level=logging.WARNING)
    _exit_with_parent(parent_pid)
    size = config.parallel.tensor_parallel_size
    config = rank_config(config, rank)
    device = torch.device(config.model.device)
    if device.type == "cuda":  # pragma: no cover - needs two GPUs
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(size))
    group = TPGroup(worker_store(port, size), rank, size, device)
    runner = ModelRunner(config, group)
    try:
        serve(runner, group)
    except Exception:  # the peers' next collective fails: rank 0 reports it
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)


@torch.inference_mode()
def serve(runner: ModelRunner, group: TPGroup) -> None:
    """Run rank 0's commands until it says stop: ("step", StepInputs) runs the forward;
    ("encode", None) runs the vision tower over the tiles rank 0 sends next."""
    while True:
        kind, payload = group.broadcast_object()
        if kind == "stop":
            return
        if kind == "step":
            runner.run(_on_device(payload, runner.device))
        elif kind == "encode":
            tiles = group.recv_object(0)
            out = None
            if tiles.shape[0]:
                vision = runner.model.vision
                out = vision.tile_features(tiles.to(runner.device, runner.dtype)).cpu()
            group.send_object(out, 0)
        else:
            raise AssertionError(f"unknown command {kind!r}")


def _on_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """The image embeddings travel through host memory; the forward wants them here."""
    if not inputs.image_rows or device.type == "cpu":
        return inputs
    rows = [(r, values.to(device), offsets) for r, values, offsets in inputs.image_rows]
    return dataclasses.replace(inputs, image_rows=rows)


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when the engine's process is gone, however it went (a SIGKILL runs no clean-up
    there): a worker waits for commands with no timeout and would otherwise live on."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="vlmserve-tp-parent", daemon=True).start()


__all__ = ["rank_config", "serve", "threads_per_rank", "worker_main"]

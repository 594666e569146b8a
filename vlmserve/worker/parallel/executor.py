"""Rank 0 of a tensor-parallel engine: starts the other ranks, sends them each step, runs
its own shard beside them, samples (vLLM's MultiprocExecutor, in miniature).

Per step: rank 0 builds the step's self-contained `StepInputs` as a single runner does
and broadcasts them (pickled, over the control group) with no sampling rows; every rank
embeds, runs its heads and MLP rows with two all-reduces per layer, and only rank 0
computes logits. Embeddings and the LM head are replicated rather than vocab-parallel:
a vocab-parallel embedding costs one more all-reduce of [tokens, hidden] per step and
the LM head a gather of [rows, vocab] to the sampler, while replication costs V·d
weights per rank; for the models served here (vocab 32-152k, d 1-4k: 0.1-0.6 G
parameters against 2-70 G) the collectives are the scarcer resource. Only rank 0 ever
runs the LM head.

The vision tower runs data-parallel (vLLM's `mm_encoder_tp_mode="data"`): each rank holds
the whole tower and encodes a contiguous share of the step's tiles; rank 0 gathers the
features, packs them per image, and they reach the other ranks inside the step's inputs.

Commands go out under one lock: a step's broadcast and its forward's collectives (or an
encode's send/receive) never interleave with another command's, whichever thread sends
(async scheduling runs the forward on its own thread while the engine thread encodes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref

import torch
import torch.multiprocessing as mp

from encoders.vision import VisionEncoder, VisionInput
from encoders.weights import read_config
from vlmserve.config import EngineConfig
from vlmserve.worker.models.loader import decoder_config
from vlmserve.worker.parallel.comm import TPGroup, master_store
from vlmserve.worker.parallel.sharding import check_tensor_parallel
from vlmserve.worker.parallel.worker import rank_config, threads_per_rank, usable_cores, worker_main
from vlmserve.worker.runner import ModelRunner, StepInputs

log = logging.getLogger(__name__)

_JOIN_S = 10.0


def make_runner(config: EngineConfig) -> ModelRunner:
    """The engine's runner: this process alone, or rank 0 of a tensor-parallel group."""
    if config.parallel.tensor_parallel_size == 1:
        return ModelRunner(config)
    return TensorParallelRunner(config)


def check_config(config: EngineConfig) -> None:
    """ValueError naming the flag when the checkpoint cannot split over the ranks (read
    from its config.json, before any process starts); a warning past the core count."""
    size = config.parallel.tensor_parallel_size
    try:
        check_tensor_parallel(decoder_config(read_config(config.model.path)), size)
    except ValueError as e:
        raise ValueError(f"--tensor-parallel-size: {e}") from None
    if torch.device(config.model.device).type == "cpu" and size > usable_cores():
        log.warning(
            "--tensor-parallel-size %d is more than the %d cores: ranks share cores",
            size, usable_cores(),
        )  # fmt: skip


class _Channel:
    """The group and the lock every command from rank 0 holds; `broken` once a command
    failed half-way (the ranks may then be out of step: no further command is sent)."""

    def __init__(self, group: TPGroup, processes: list) -> None:
        self.group, self.processes = group, processes
        self.lock = threading.Lock()
        self.broken: str | None = None

    def check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel group unusable: {self.broken}")
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                self.broken = f"rank {rank} exited with code {proc.exitcode}"
                raise RuntimeError(f"tensor-parallel group unusable: {self.broken}")


class TensorParallelRunner(ModelRunner):
    """A ModelRunner that is rank 0 of `config.parallel.tensor_parallel_size` ranks."""

    def __init__(self, config: EngineConfig) -> None:
        check_config(config)
        size = config.parallel.tensor_parallel_size
        config = rank_config(config, 0)
        threads_before = torch.get_num_threads()
        if torch.device(config.model.device).type == "cpu":
            torch.set_num_threads(threads_per_rank(size))
        store = master_store(size)
        context = mp.get_context("spawn")
        processes = [
            context.Process(
                target=worker_main,
                args=(config, rank, store.port, os.getpid()),
                name=f"vlmserve-tp{rank}",
                daemon=True,
            )  # fmt: skip
            for rank in range(1, size)
        ]
        for proc in processes:
            proc.start()
        # Stops the workers when this runner is closed, collected, or the process exits,
        # and if the start below fails: never a process left behind.
        channel: list[_Channel] = []
        self._finalizer = weakref.finalize(
            self, _shutdown, channel, processes, threads_before, store
        )
        try:
            group = TPGroup(store, 0, size, torch.device(config.model.device))
            channel.append(_Channel(group, processes))
            super().__init__(config, group)
        except BaseException:
            self._finalizer()
            raise
        self._channel = channel[0]
        if self.encoder_stage is not None:
            self.encoder_stage.vision = DataParallelVision(self.model.vision, self._channel)

    @torch.inference_mode()
    def run(
        self,
        inputs: StepInputs,
        previous: list[list[int] | Exception] | None = None,
        greedy: bool = False,
    ) -> torch.Tensor:
        self._fill_pending_rows(inputs, previous)
        shared = dataclasses.replace(
            inputs, pending_rows=[], sample_rows=inputs.sample_rows[:0],
            image_rows=[(r, values.cpu(), o) for r, values, o in inputs.image_rows],
        )  # fmt: skip
        channel = self._channel
        with channel.lock:
            channel.check()
            try:
                channel.group.broadcast_object(("step", shared))
                return super().run(inputs, previous, greedy)
            except Exception as e:
                channel.broken = f"a step failed on rank 0: {e!r}"
                raise

    def close(self) -> None:
        self._finalizer()


class DataParallelVision:
    """The vision encoder with its tower's tiles spread over the ranks (each rank holds
    the whole tower); per-image packing stays on rank 0. Same `encode` as VisionEncoder."""

    def __init__(self, vision: VisionEncoder, channel: _Channel) -> None:
        self.vision, self.channel = vision, channel

    def encode(self, images: list[VisionInput]) -> list[torch.Tensor]:
        return self.vision.encode(images, tile_features=self._tile_features)

    def _tile_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, H, W] -> [tiles, tokens_per_tile, hidden]: rank r encodes the r-th
        contiguous share (sizes differ by at most one; rank 0's is never empty)."""
        channel = self.channel
        group = channel.group
        shares = pixel_values.tensor_split(group.size)
        with channel.lock:
            channel.check()
            try:
                group.broadcast_object(("encode", None))
                for rank in range(1, group.size):
                    group.send_object(shares[rank].cpu(), rank)
                parts = [self.vision.tile_features(shares[0])]
                for rank in range(1, group.size):
                    part = group.recv_object(rank)
                    if part is not None:
                        parts.append(part.to(parts[0].device))
            except Exception as e:
                channel.broken = f"a vision-tower share failed: {e!r}"
                raise
        return torch.cat(parts)


def _shutdown(channel: list[_Channel], processes: list, threads_before: int, store: object) -> None:
    """Tell live workers to stop (when no command is in flight), then make sure: SIGTERM,
    then SIGKILL, each after a bounded wait. Restores this process's thread count."""
    if channel and all(p.is_alive() for p in processes):
        ch = channel[0]
        if ch.broken is None and ch.lock.acquire(timeout=1.0):
            try:
                ch.group.broadcast_object(("stop", None))
            except Exception as e:  # noqa: BLE001 - the workers are ended below either way
                log.warning("tensor-parallel stop message failed: %r", e)
            finally:
                ch.lock.release()
    for proc in processes:
        proc.join(_JOIN_S)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
            proc.join(_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    del store  # the rendezvous store lives until the workers are gone
    torch.set_num_threads(threads_before)

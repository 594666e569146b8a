"""`--nano-batch auto`: the schedules an engine runs, found by the auto-search for its own
model and device at start-up, and cached (beside `vlmserve estimate pipeline`'s) so that
the next start reads them back.

Profiles are measured on a CPU (`vlmserve/worker/nano_profile.py`, keyed by the CPU's model and
instruction sets: another CPU is profiled anew) and synthetic on a GPU (the cost model on
the accelerator preset its name matches, and Table 3). Both depend only on the decoder's
shape, so they are keyed by the shape, not by the checkpoint's name. One schedule is
searched per dense batch the engine's steps can reach; the runner uses the largest one not
above a step's rows, and only where its schedule says overlap pays.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from pathlib import Path

from search.costmodel.presets import ModelShape, get_accelerator, get_model, gpu_preset
from search.nanoflow import profiles as profile_store
from search.nanoflow.auto_search import cached_schedule
from search.nanoflow.schedule import Schedule

CPU_DENSE_BATCHES = (64, 128, 256)  # multiples of the CPU profiles' 16 rows
GPU_DENSE_BATCHES = (256, 512, 1024, 2048)  # multiples of the GPU profiles' 128 rows
TIME_LIMIT_S = 5.0  # per MILP solve: the first start of a new shape waits for the search


@dataclass(frozen=True)
class EngineSchedules:
    schedules: list[Schedule]
    cached: bool  # every schedule (and the profiles) came from the cache
    seconds: float  # profiling + search time of this call

    @property
    def paying_batches(self) -> list[int]:
        """The dense batches whose schedule splits the layer and beats running in order."""
        return [s.dense_batch for s in self.schedules if s.notes.get("overlap_pays")]


def dense_batches(device_type: str, max_rows: int) -> list[int]:
    """The searched dense batches a step of at most `max_rows` rows can use."""
    candidates = CPU_DENSE_BATCHES if device_type == "cpu" else GPU_DENSE_BATCHES
    return [b for b in candidates if b <= max_rows]


def shape_key(model: ModelShape) -> str:
    """The cache name of a decoder shape: what the profiles depend on."""
    return (
        f"l{model.num_layers}-h{model.hidden_size}-q{model.num_heads}-kv{model.num_kv_heads}"
        f"-d{model.head_dim}-ff{model.intermediate_size}-v{model.vocab_size}"
    )


def cpu_device_key() -> str:
    """The device key of this CPU, "cpu-" and a digest of its model and flags: profiles
    measured on another CPU are not this one's."""
    from kernels.cpu_build import cpu_features

    return "cpu-" + hashlib.sha256(cpu_features().encode()).hexdigest()[:8]


def engine_schedules(
    model_dir: str,
    device_type: str,
    max_rows: int,
    device_name: str = "",
    cache_dir: Path | None = None,
    time_limit_s: float = TIME_LIMIT_S,
) -> EngineSchedules:
    """The searched schedules of the checkpoint `model_dir` on this device, for each dense
    batch up to `max_rows` (the engine's per-step token budget), from the cache where it has
    them. Raises ValueError where no schedule can be searched (a GPU no preset matches)."""
    t0 = time.perf_counter()
    cache_dir = cache_dir or profile_store.DEFAULT_CACHE_DIR
    shape = get_model(model_dir)
    model = replace(shape, name=shape_key(shape))
    batches = dense_batches(device_type, max_rows)
    if not batches:
        return EngineSchedules([], True, time.perf_counter() - t0)
    largest = max(batches)
    if device_type == "cpu":
        device = cpu_device_key()
        profiles = profile_store.try_load_profiles(cache_dir, model.name, device)
        cached = profiles is not None and profiles.max_tokens >= largest
        if not cached:
            from vlmserve.worker.nano_profile import measure_cpu_profiles

            profiles = replace(measure_cpu_profiles(model, largest), device=device)
            profile_store.save_profiles(profiles, cache_dir)
    else:
        preset = gpu_preset(
            device_name,
            "search a schedule with `vlmserve estimate pipeline` and give "
            "--nano-batch its JSON file",
        )
        accelerator = get_accelerator(preset)
        profiles = profile_store.synthetic_gpu_profiles(model, accelerator, largest)
        cached = True  # computed, not measured: nothing to wait for or to keep
    schedules = []
    for batch in batches:
        schedule, hit = cached_schedule(profiles, batch, cache_dir, time_limit_s)
        schedules.append(schedule)
        cached = cached and hit
    return EngineSchedules(schedules, cached, time.perf_counter() - t0)

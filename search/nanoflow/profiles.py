"""Kernel profiles (NanoFlow §4.1.1): each op's interference-free time D_best over token
counts, and the R → P interference table the Stage II MILP reads.

Token counts are multiples of a granularity: 128 on a GPU ("a hardware-friendly shape
for GEMM tiling"), 16 on a CPU. Profiles come from one of two places:

- `synthetic_gpu_profiles`: the op graph priced by the cost model (search/nanoflow/op_graph.py)
  and NanoFlow's Table 3 for interference: what the search runs on without the device;
- `vlmserve.worker.nano_profile.measure_cpu_profiles`: the real decoder layer timed on this CPU.

Either way they are cached as JSON per (model, device) under the cache folder.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from search.costmodel.presets import Accelerator, ModelShape
from search.nanoflow.op_graph import BatchMix, Partitioning, layer_ops, op_time_s
from search.nanoflow.schedule import Resource

GPU_GRANULARITY = 128
CPU_GRANULARITY = 16
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "vlmserve" / "search"

# NanoFlow Table 3: a memory-bound (GEMV) or network kernel given a share R of the GPU
# runs at P of its interference-free speed. The table gives R = 0.2 and 0.8; the ends
# are exact (no share: no progress; the whole GPU: its best time) and between knots P is
# linear. Those four knots make P concave in R, so D/P(R) is convex and Stage II can
# bound it from below with straight lines (no binaries).
TABLE3_KNOTS: dict[str, tuple[tuple[float, float], ...]] = {
    "memory": ((0.0, 0.0), (0.2, 0.3), (0.8, 0.85), (1.0, 1.0)),
    "network": ((0.0, 0.0), (0.2, 0.5), (0.8, 0.9), (1.0, 1.0)),
}
# A GEMM given R of the compute runs at P = R by the definition of R (§4.1.1).
LINEAR_KNOTS: tuple[tuple[float, float], ...] = ((0.0, 0.0), (1.0, 1.0))


@dataclass(frozen=True)
class OpProfile:
    """D_best of one op (microseconds) at each profiled token count."""

    op: str
    resource: Resource
    token_counts: tuple[int, ...]
    times_us: tuple[float, ...]


@dataclass(frozen=True)
class Profiles:
    """Everything the search knows about one (model, device)."""

    model: str
    device: str
    granularity: int
    ops: tuple[OpProfile, ...]  # in LAYER_OPS order
    # resource -> (R, P) knots, R ascending from 0 to 1; compute is always P = R.
    interference: dict[str, tuple[tuple[float, float], ...]]
    source: str  # "synthetic" or "measured"
    notes: dict = field(default_factory=dict)

    @property
    def max_tokens(self) -> int:
        return min(p.token_counts[-1] for p in self.ops)

    def op(self, name: str) -> OpProfile:
        for p in self.ops:
            if p.op == name:
                return p
        raise KeyError(name)

    def time_us(self, name: str, tokens: int) -> float:
        """D_best at `tokens` (linear between profiled counts, from 0 at 0 tokens)."""
        p = self.op(name)
        return _interpolate(((0, 0.0), *zip(p.token_counts, p.times_us, strict=True)), tokens)

    def knots(self, resource: str) -> tuple[tuple[float, float], ...]:
        return LINEAR_KNOTS if resource == "compute" else self.interference[resource]

    def perf(self, resource: str, share: float) -> float:
        """P: the fraction of its best speed an op of `resource` runs at with share R."""
        return _interpolate(self.knots(resource), share)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profiles:
        raw = json.loads(text)
        raw["ops"] = tuple(
            OpProfile(p["op"], p["resource"], tuple(p["token_counts"]), tuple(p["times_us"]))
            for p in raw["ops"]
        )
        raw["interference"] = {
            k: tuple(tuple(knot) for knot in v) for k, v in raw["interference"].items()
        }
        return cls(**raw)


def _interpolate(points, x: float) -> float:
    xs = [p[0] for p in points]
    if not xs[0] <= x <= xs[-1]:
        raise ValueError(f"{x} is outside the profiled range [{xs[0]}, {xs[-1]}]")
    i = max(1, bisect.bisect_left(xs, x))
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def device_key(accel_name: str, tp: int, partitioning: Partitioning = "allreduce") -> str:
    """ "a100", "a100-tp8" (the all-reduce partitioning), "a100-tp8-allgather"."""
    if tp == 1:
        return accel_name
    return f"{accel_name}-tp{tp}" + ("" if partitioning == "allreduce" else f"-{partitioning}")


def synthetic_gpu_profiles(
    model: ModelShape,
    accel: Accelerator,
    max_tokens: int,
    tp: int = 1,
    mix: BatchMix | None = None,
    granularity: int = GPU_GRANULARITY,
    partitioning: Partitioning = "allreduce",
) -> Profiles:
    """Profiles of `model` at TP `tp` on `accel` from the cost model, Table 3 for R → P,
    the attention half's collectives those of `partitioning` (op_graph.PARTITIONINGS)."""
    if max_tokens < granularity or max_tokens % granularity:
        raise ValueError(f"max tokens {max_tokens} is not a multiple of {granularity}")
    counts = tuple(range(granularity, max_tokens + 1, granularity))
    mix = mix or BatchMix()
    ops = tuple(
        OpProfile(
            op.name,
            op.resource,
            counts,
            tuple(op_time_s(op, n, accel) * 1e6 for n in counts),
        )
        for op in layer_ops(model, accel, max_tokens, tp, mix, partitioning=partitioning)
    )
    return Profiles(
        model.name,
        device_key(accel.name, tp, partitioning),
        granularity,
        ops,
        dict(TABLE3_KNOTS),
        "synthetic",
        {"mix": asdict(mix), "tp": tp, "partitioning": partitioning},
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def profile_path(cache_dir: Path, model: str, device: str) -> Path:
    return cache_dir / f"profile-{_slug(model)}-{_slug(device)}.json"


def save_profiles(profiles: Profiles, cache_dir: Path) -> Path:
    path = profile_path(cache_dir, profiles.model, profiles.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profiles.to_json())
    return path


def try_load_profiles(cache_dir: Path, model: str, device: str) -> Profiles | None:
    path = profile_path(cache_dir, model, device)
    return Profiles.from_json(path.read_text()) if path.is_file() else None

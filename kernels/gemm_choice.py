"""Which float32 GEMM a large prefill chunk takes on this CPU: oneDNN's packed GEMM or MKL
on the plain weight, measured once per CPU instead of a constant tuned on one machine.

MKL's large-GEMM path beat oneDNN's packed GEMM from ~1,536 rows on a Zen 3 (AVX2), but
MKL runs its AVX-512 kernels on Intel CPUs only: on a Zen 5 with AVX-512 it measured
15.6 GFLOP/s against oneDNN's 33.4 (benchmarks/ops/gemm_crossover.py has the sweep). So
the choice is calibrated: one square GEMM (CALIBRATION_DIM, a typical decoder width) at
2,048 and 1,024 rows through both paths, interleaved (`decide`): never where MKL lost at
2,048 rows; from 1,024 where it won at both; halfway (1,536) where it won at 2,048 only. About
a second of GEMMs, once per CPU model, torch version and thread count: the answer is kept
in a JSON file under ~/.cache/vlmserve/ (`cache_path`). `decide` is the pure rule, tested
on its own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cpu_build

log = logging.getLogger(__name__)

CALIBRATION_DIM = 1024  # K = N of the calibration GEMM
CALIBRATION_ROWS = (2048, 1024)  # measured largest first: a loss at 2,048 ends it
MARGIN = 1.10  # MKL must be this much faster: worth a second path, above a loaded machine's noise
CACHE_DIR = Path.home() / ".cache" / "vlmserve" / "gemm_choice"
_ROUNDS = 3  # timed calls a path a size (after one untimed: oneDNN's primitive, MKL's pack)


def decide(seconds: dict[int, tuple[float, float]]) -> int | None:
    """The fewest rows from which MKL is taken, None: never. `seconds`: rows -> (oneDNN
    packed, MKL plain) median seconds. MKL must win by MARGIN at the largest size and at
    every size down to the one chosen; where it lost at a smaller size, the crossover is
    taken halfway between that size and the smallest it won at."""
    chosen = None
    for rows in sorted(seconds, reverse=True):
        onednn, mkl = seconds[rows]
        if onednn >= MARGIN * mkl:  # MKL won
            chosen = rows
            continue
        return None if chosen is None else (chosen + rows) // 2
    return chosen


def measure(rows_list: tuple[int, ...] = CALIBRATION_ROWS) -> dict[int, tuple[float, float]]:
    """rows -> (oneDNN packed, MKL plain) median seconds of a CALIBRATION_DIM-square float32
    GEMM, the two alternating; stops after the first size where oneDNN wins."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(CALIBRATION_DIM, CALIBRATION_DIM, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    result = {}
    for rows in rows_list:
        x = torch.randn(rows, CALIBRATION_DIM, generator=gen)
        paths: list[Callable[[], object]] = [
            lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            lambda x=x: F.linear(x, weight),
        ]
        times: list[list[float]] = [[], []]
        for round_ in range(_ROUNDS + 1):
            for i, path in enumerate(paths):
                start = time.perf_counter()
                path()
                if round_:  # the first round builds the primitives
                    times[i].append(time.perf_counter() - start)
        onednn, mkl = (statistics.median(t) for t in times)
        result[rows] = (onednn, mkl)
        if onednn < MARGIN * mkl:  # MKL lost: smaller sizes would not change the choice
            break
    return result


def cache_path() -> Path:
    """The calibration's file for this CPU, torch version and thread count."""
    key = f"{cpu_build.cpu_features()}\n{torch.__version__}\n{torch.get_num_threads()}"
    return CACHE_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


@functools.cache
def mkl_min_rows() -> int | None:
    """The fewest rows a float32 layer with its plain weight sends to MKL on this CPU
    (None: never), from the cached calibration or a new one."""
    path = cache_path()
    try:
        return json.loads(path.read_text())["mkl_min_rows"]
    except (OSError, ValueError, KeyError):
        pass
    seconds = measure()
    chosen = decide(seconds)
    timings = {rows: {"onednn_s": a, "mkl_s": b} for rows, (a, b) in seconds.items()}
    log.info("float32 GEMM calibration: MKL from %s rows (%s)", chosen, timings)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"mkl_min_rows": chosen, "seconds": timings}))
    except OSError:
        pass  # a read-only home: calibrated again next start
    return chosen

"""Every kernel choice on the CPU path, measured on the CPU that runs it, at first use, and
cached: never a constant tuned on one machine.

A choice that wins 5x on one CPU can lose 3x on the next: the C++ bfloat16 prefill
attention kernel ran at 4.5-6.1x torch's SDPA on a Zen 5 and at 0.36-0.60x on an AMX Xeon,
where oneDNN's bfloat16 GEMM (AMX tiles) also beats the skinny kernel on the LM head at a
few dozen rows. So each choice site (kernels/packed_linear.py: the skinny kernel's rows per
dtype and layer shape, the LM head's paths, float32 MKL from how many rows;
kernels/cpu_attention.py: the prefill attention kernel or SDPA per dtype and head shape,
in the decoder and in the vision tower's tiles)
times its candidates here (`time_paths`: interleaved, a few rounds, robust to a shared
machine's lost time slices; the load average is kept beside them) and hands
the measurements to a pure rule below (`decide_*`, tested on their own). `calibrated`
keeps each choice's measurements in one JSON file per machine key (`machine_key`: the CPU
model, its flags, torch's version, the thread count, this protocol's version, the C++
kernels' sources) under
~/.cache/vlmserve/calibration/, and recalibrates where the key changed; the rule is applied
to the stored measurements on load. VLMSERVE_RECALIBRATE=1 (or `vlmserve info
--recalibrate`) measures anew. A model's whole calibration costs a few seconds at its
first start on a machine (`vlmserve info` prints each choice, its measurements and how long
they took); nothing afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from kernels import cpu_build

log = logging.getLogger(__name__)

VERSION = 3  # of the measurement protocol: a change recalibrates every machine
CACHE_DIR = Path.home() / ".cache" / "vlmserve" / "calibration"
RECALIBRATE_ENV = "VLMSERVE_RECALIBRATE"
ROUNDS = 3  # timed samples a path at least (after untimed calls: primitives built, caches warm)
MAX_ROUNDS = 9
SIZE_BUDGET_S = 0.03  # short paths: rounds added up to about this long a size
MIN_SAMPLE_S = 2e-3  # a sample repeats a short call until it lasts about this long
# A path that costs memory or a second code path (MKL on a plain copy, a packed copy of a
# tied LM head) must win by this much: above a loaded machine's noise.
MARGIN = 1.10

Measured = list[dict[str, float]]  # one record per size: {"rows": n, path: seconds, ...}
T = TypeVar("T")

# -- the pure rules -----------------------------------------------------------------------


def decide_mkl(seconds: Measured) -> int | None:
    """The fewest rows from which float32 MKL (plain weight) is taken over oneDNN's packed
    GEMM, None: never. Records {"rows", "onednn", "mkl"}. MKL must win by MARGIN at the
    largest size and at every size down to the one chosen; where it lost at a smaller size,
    the crossover is taken halfway between that size and the smallest it won at."""
    chosen = None
    for rec in sorted(seconds, key=lambda r: -r["rows"]):
        rows = int(rec["rows"])
        if rec["onednn"] >= MARGIN * rec["mkl"]:  # MKL won
            chosen = rows
            continue
        return None if chosen is None else (chosen + rows) // 2
    return chosen


def decide_max_rows(seconds: Measured, fast: str, slow: str) -> int:
    """The most rows the `fast` path takes (0: none): the measured size T minimising the
    summed time, relative to the faster path at each size, of `fast` up to T and `slow`
    above it. On timings that cross once this is the last size `fast` won; one noisy
    sample on either side of the crossover does not move it far."""
    ladder = sorted(seconds, key=lambda r: r["rows"])
    best, best_cost = 0, math.inf
    for cut in range(len(ladder) + 1):  # `fast` takes ladder[:cut]
        cost = sum(
            (r[fast] if i < cut else r[slow]) / min(r[fast], r[slow]) for i, r in enumerate(ladder)
        )
        if cost < best_cost - 1e-9:  # ties: the smaller cut (fewer rows on `fast`)
            best, best_cost = (int(ladder[cut - 1]["rows"]) if cut else 0), cost
    return best


class HeadChoice(NamedTuple):
    """How the LM head computes float32 logits: the skinny kernel (float32 sums as they
    are) up to `skinny_max_rows` rows, above them a GEMM on the packed weight ("packed":
    oneDNN's blocked layout, AMX tiles where the CPU has them) or on the plain one
    ("plain": torch's F.linear), widened to float32. With "packed", `plain_min_rows` (None:
    never) is where the plain weight takes over again: the two GEMMs cross over by batch
    size on some CPUs (a Zen 4's packed GEMM 4x the plain one at 16 rows, level at 256).
    `amx_min_rows` (None: never) to `amx_max_rows` (None: no end): the AMX tile kernel
    on its own packed copy of the weight (`packed_linear.amx_linear`, `amx_bf16` CPUs)."""

    skinny_max_rows: int
    gemm: str
    plain_min_rows: int | None = None
    amx_min_rows: int | None = None
    amx_max_rows: int | None = None

    def takes_amx(self, rows: int) -> bool:
        return (
            self.amx_min_rows is not None
            and self.amx_min_rows <= rows
            and (self.amx_max_rows is None or rows <= self.amx_max_rows)
        )


def decide_head(seconds: Measured) -> HeadChoice:
    """Records {"rows", "skinny", "packed", "plain"} (and "amx" where measured). The
    skinny kernel's rows against the fastest GEMM at each size (`decide_max_rows`); then,
    over the sizes a GEMM takes (all of them where the skinny kernel took every size), the
    packed GEMM up to the rows where it beat the plain one by MARGIN (`decide_max_rows` on
    the packed times scaled by MARGIN: a tied head holds the packed weight as a second
    copy), the plain one above them; and the AMX kernel over the sizes where it beats the
    faster of those two by MARGIN (its own copy of the weight too): up to the most rows it
    takes against them (`decide_max_rows`), from the fewest below that."""
    gemms = tuple(g for g in ("packed", "plain", "amx") if g in seconds[0])
    gemm = [{"rows": r["rows"], "skinny": r["skinny"], "gemm": min(r[g] for g in gemms)}
            for r in seconds]  # fmt: skip
    skinny = decide_max_rows(gemm, "skinny", "gemm")
    above = [r for r in seconds if r["rows"] > skinny] or seconds
    largest = max(int(r["rows"]) for r in above)
    amx: tuple[int | None, int | None] = (None, None)
    if "amx" in gemms:
        versus = [{"rows": r["rows"], "gemm": min(r["packed"], r["plain"]),
                   "amx": MARGIN * r["amx"]} for r in above]  # fmt: skip
        amx_max = decide_max_rows(versus, "amx", "gemm")
        gemm_max = decide_max_rows([r for r in versus if r["rows"] <= amx_max], "gemm", "amx")
        if amx_max > 0 and gemm_max < amx_max:
            amx = (max(gemm_max, skinny) + 1, None if amx_max >= largest else amx_max)
    if "packed" not in gemms:  # oneDNN takes no such weight here (packable)
        return HeadChoice(skinny, "plain", None, *amx)
    handicapped = [{**r, "packed": MARGIN * r["packed"]} for r in above]
    packed_max = decide_max_rows(handicapped, "packed", "plain")
    if packed_max == 0:
        return HeadChoice(skinny, "plain", None, *amx)
    plain_min = None if packed_max >= largest else packed_max + 1
    return HeadChoice(skinny, "packed", plain_min, *amx)


def decide_greedy(seconds: Measured) -> tuple[int, int | None] | None:
    """Records {"rows", "logits", "fused"}: the rows (fewest, most; None: no end) at which
    greedy decoding takes its tokens from the fused AMX argmax rather than from the head's
    logits, as `decide_head` places the AMX kernel: up to the most rows it takes against
    the logits path (`decide_max_rows`), from the fewest below that; None: never. No
    MARGIN: the fused path holds no weight of its own (it reads the AMX head's copy)."""
    fused_max = decide_max_rows(seconds, "fused", "logits")
    logits_max = decide_max_rows([r for r in seconds if r["rows"] <= fused_max], "logits", "fused")
    if fused_max == 0 or logits_max >= fused_max:
        return None
    largest = max(int(r["rows"]) for r in seconds)
    return logits_max + 1, None if fused_max >= largest else fused_max


def decide_faster(seconds: Measured, first: str, second: str) -> bool:
    """Whether `first` took less time than `second`, summed over the records."""
    return sum(r[first] for r in seconds) <= sum(r[second] for r in seconds)


# -- timing -------------------------------------------------------------------------------


def time_paths(paths: dict[str, Callable[[], object]], rounds: int = ROUNDS) -> dict[str, float]:
    """Seconds a call of each path (`low_quartile` of its samples), the paths taking turns
    (the order reversed every other round, so that neither always runs first); each path's
    calls repeated within a sample until it lasts about MIN_SAMPLE_S; short paths get more
    rounds (up to MAX_ROUNDS, within about SIZE_BUDGET_S): on a shared machine a sample can
    lose a scheduler slice, and more samples drop those."""
    repeats, once = {}, {}
    for name, path in paths.items():
        start = time.perf_counter()
        path()  # untimed: oneDNN builds its primitive, MKL packs, caches warm
        once[name] = time.perf_counter() - start
        if once[name] < 10 * MIN_SAMPLE_S:  # a short call: once more, without the set-up
            start = time.perf_counter()
            path()
            once[name] = time.perf_counter() - start
        repeats[name] = max(1, min(64, math.ceil(MIN_SAMPLE_S / max(once[name], 1e-7))))
    per_round = sum(repeats[name] * once[name] for name in paths)
    rounds = max(rounds, min(MAX_ROUNDS, int(SIZE_BUDGET_S / max(per_round, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for round_ in range(rounds):
        order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
        for name in order:
            start = time.perf_counter()
            for _ in range(repeats[name]):
                paths[name]()
            samples[name].append((time.perf_counter() - start) / repeats[name])
    return {name: low_quartile(s) for name, s in samples.items()}


def low_quartile(samples: list[float]) -> float:
    """The median of the faster half of the samples: a path's own time on a shared machine,
    where a sample only ever loses time (to another process, to an OpenMP thread that lost
    its core), without taking one lucky sample as the answer."""
    ordered = sorted(samples)
    return statistics.median(ordered[: max(1, (len(ordered) + 1) // 2)])


# -- the cache ----------------------------------------------------------------------------


def machine_key() -> dict[str, str]:
    """What a calibration holds for: the CPU (vendor, family, model, its name and flags),
    torch's version, the thread count, this protocol's version and the kernels' sources
    (a faster kernel moves its crossovers)."""
    fields: dict[str, str] = {}
    for line in cpu_build.cpu_features().splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = " ".join(value.split())
    cpu = fields.get("model name") or fields.get("CPU part") or "unknown"
    ident = " ".join(fields.get(k, "") for k in ("vendor_id", "cpu family", "model")).strip()
    flags = " ".join(sorted((fields.get("flags") or fields.get("Features") or "").split()))
    return {
        "cpu": f"{cpu} ({ident})" if ident else cpu,
        "flags": flags,
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "version": str(VERSION),
        "kernels": cpu_build.sources_digest(),
    }


def cache_path() -> Path:
    """This machine key's calibration file."""
    key = json.dumps(machine_key(), sort_keys=True)
    return CACHE_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


# (cache file, choice name) -> the stored entry, for this process: a file is read once,
# and under VLMSERVE_RECALIBRATE each choice is measured once.
_entries: dict[tuple[str, str], dict[str, Any]] = {}


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("choices", {}) if isinstance(data, dict) else {}


def _write(path: Path, name: str, entry: dict[str, Any]) -> None:
    """Add one choice to the file (read again first: another process, a tensor-parallel
    rank, may have added its own); replaced whole, never half written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        choices = _read(path)
        choices[name] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": machine_key(), "choices": choices}, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: calibrated again next start
        log.warning("calibration not cached (%s): %s", path, e)


def calibrated(name: str, measure: Callable[[], Measured], decide: Callable[[Measured], T]) -> T:
    """`decide` applied to the measurements of choice `name` on this machine: stored ones,
    or `measure()`'s, then stored. `name` names what was measured (dtype, shape)."""
    path = cache_path()
    memo = (str(path), name)
    entry = _entries.get(memo)
    if entry is None and os.environ.get(RECALIBRATE_ENV) != "1":
        entry = _read(path).get(name)
        try:  # a stored entry the rule cannot read (edited, truncated): measured again
            decide(entry["measured"]) if entry is not None else None
        except (KeyError, TypeError, ValueError):
            entry = None
    if entry is None:
        load = os.getloadavg()[0]  # beside the measurements: a loaded machine's are noisy
        start = time.perf_counter()
        measured = measure()
        took = time.perf_counter() - start
        entry = {"measured": measured, "seconds": round(took, 3), "load_average": load}
        entry["choice"] = _jsonable(decide(measured))
        log.info("calibrated %s in %.2f s: %s", name, took, entry["choice"])
        _write(path, name, entry)
    _entries[memo] = entry
    return decide(entry["measured"])


def _jsonable(value: object) -> object:
    return value._asdict() if isinstance(value, tuple) and hasattr(value, "_asdict") else value


def report(asked_only: bool = False) -> dict[str, Any]:
    """This machine's calibration as stored: the file, its key, and per choice the choice,
    the measurements behind it and how long they took (what `vlmserve info` prints);
    `asked_only`: the choices this process asked for, not every shape stored."""
    path = cache_path()
    choices = _read(path)
    if asked_only:
        asked = {name for file, name in _entries if file == str(path)}
        choices = {name: entry for name, entry in choices.items() if name in asked}
    return {"cache": str(path), "key": machine_key(), "choices": choices}


def forget() -> None:
    """Drop this machine's stored calibration: every choice is measured again at its next
    use (`vlmserve info --recalibrate`)."""
    path = cache_path()
    path.unlink(missing_ok=True)
    for memo in [m for m in _entries if m[0] == str(path)]:
        del _entries[memo]

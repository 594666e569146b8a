"""Time-boxed coverage-guided fuzzing of the image path: `read_header`, `decode_rgb` and
`load_image` on mutated bytes, seeded from the reliability corpus.

A finding is any exception other than a `RequestError` subclass (the typed 4xx/503 a
request gets), or a RequestError whose message leaks a repr, a path or a command line.
Each is printed and its input saved under benchmarks/results/fuzz_findings/ (named by
its hash). The run goes on to the end of the time box; libFuzzer then prints its final
stats (`stat::number_of_executed_units`), and benchmarks/results/fuzz_findings/
summary.json holds the counts (rewritten every 2000 executions and on each finding,
since libFuzzer ends the process itself).

atheris is not a project dependency:
    .venv/bin/pip install atheris
    .venv/bin/python -m benchmarks.reliability.atheris_images --seconds 180
Replay one saved input: `--replay benchmarks/results/fuzz_findings/<hash>.bin`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["PIL", "encoders"]):  # not torch (connectors)
    from PIL import Image  # noqa: F401 - instrumented for its plugins

    from encoders.errors import RequestError
    from encoders.image_io import decode_rgb, read_header
    from encoders.images import load_image
    from encoders.pixel_budget import PixelBudget

from benchmarks.lib.common import RESULTS
from benchmarks.reliability.corpus import generate_corpus

FINDINGS = RESULTS / "fuzz_findings"
MAX_PIXELS = 4_000_000  # small, so each input decodes in milliseconds
LEAKS = re.compile(r"\b0x[0-9a-f]{6,}|/tmp/|gs |Traceback|<.* object at")
_BUDGET = PixelBudget(2 * MAX_PIXELS)
_STATE = {"executions": 0, "findings": 0, "started": time.time()}
_SEEN: set[str] = set()


def check(data: bytes) -> None:
    """Run every entry point on `data`; raise AssertionError or the escaped exception."""
    for entry in (
        lambda: read_header(data, MAX_PIXELS),
        lambda: decode_rgb(data, max_pixels=MAX_PIXELS),
        lambda: load_image(data, MAX_PIXELS, _BUDGET, timeout=5),
    ):
        try:
            entry()
        except RequestError as e:
            assert not LEAKS.search(str(e)), f"message leaks: {e}"


def one_input(data: bytes) -> None:
    _STATE["executions"] += 1
    try:
        check(data)
    except Exception as e:  # noqa: BLE001 - every escape is a finding
        _record(data, e)
    if _STATE["executions"] % 2000 == 0:
        _write_summary()


def _record(data: bytes, error: BaseException) -> None:
    # One finding per (exception type, innermost frame): mutations of the same bug are noise.
    frame = traceback.extract_tb(error.__traceback__)[-1]
    key = f"{type(error).__name__}:{frame.filename}:{frame.lineno}"
    if key in _SEEN:
        return
    _SEEN.add(key)
    _STATE["findings"] += 1
    FINDINGS.mkdir(parents=True, exist_ok=True)
    path = FINDINGS / f"{hashlib.sha1(data).hexdigest()[:16]}.bin"
    path.write_bytes(data)
    print(f"FINDING {key}: {type(error).__name__}: {str(error)[:200]} -> {path}", flush=True)
    _write_summary()


def _write_summary() -> None:
    FINDINGS.mkdir(parents=True, exist_ok=True)
    summary = {**_STATE, "seconds": round(time.time() - _STATE["started"], 1),
               "distinct": sorted(_SEEN)}  # fmt: skip
    (FINDINGS / "summary.json").write_text(json.dumps(summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--max-len", type=int, default=1 << 16)
    parser.add_argument("--replay", type=Path, help="run one saved input and show its error")
    args, rest = parser.parse_known_args()
    if args.replay is not None:
        check(args.replay.read_bytes())
        print("no finding")
        return
    # libFuzzer exits the process itself at the end of the time box, so the working corpus
    # lives at a fixed temp path that the next run clears.
    work = Path(tempfile.gettempdir()) / "vlmserve_fuzz_images"
    shutil.rmtree(work, ignore_errors=True)
    seeds = work / "corpus"
    seeds.mkdir(parents=True)
    for item in generate_corpus(work / "generated", seed=0, num_bad=200):
        if item.path.stat().st_size <= args.max_len:
            shutil.copy(item.path, seeds / item.path.name)
    _write_summary()
    libfuzzer = [sys.argv[0], f"-max_total_time={args.seconds}", f"-max_len={args.max_len}",
                 "-rss_limit_mb=4096", "-timeout=30", "-print_final_stats=1", *rest,
                 str(seeds)]  # fmt: skip
    atheris.Setup(libfuzzer, one_input)
    atheris.Fuzz()  # runs until the time box ends, then exits the process


if __name__ == "__main__":
    main()

"""The reliability suite: fuzzed images, fuzzed sampling fields, fuzzed constraints
(schemas, regexes, grammars, tools), SSRF probes, soak and chaos against a real `vlmserve
serve` on loopback. Minutes long, so not in the default test run (a small version of each
section is: tests/vlmserve/test_reliability_quick.py).

    .venv/bin/python -m benchmarks.reliability.run                 # everything, full sizes
    .venv/bin/python -m benchmarks.reliability.run --only soak     # one section
    .venv/bin/python -m benchmarks.reliability.run --quick         # small sizes (~2 min)

Prints a table per section and a summary; writes benchmarks/results/reliability.json
(--quick: reliability_quick.json; --only updates just its section in the file). Exits 1
when any check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.lib.common import table, write_json
from benchmarks.reliability.common import RESULT_PATH, git_rev, load_average

SECTIONS = ("fuzz", "fields", "schema", "ssrf", "soak", "chaos")


def run_section(name: str, quick: bool, root: Path | None, num_soak: int | None = None) -> dict:
    if name == "fuzz":
        from benchmarks.reliability.fuzz_http import run_fuzz

        return run_fuzz(num_bad=60 if quick else 500, root=root)
    if name == "fields":
        from benchmarks.reliability.fuzz_fields import run_fields

        return run_fields(num=90 if quick else 600, root=root)
    if name == "schema":
        from benchmarks.reliability.fuzz_schema import run_schema_fuzz

        return run_schema_fuzz(num=60 if quick else 400, root=root)
    if name == "ssrf":
        from benchmarks.reliability.ssrf_http import run_ssrf

        return run_ssrf(root=root)
    if name == "soak":
        return run_soaks(quick, root, num_soak)
    from benchmarks.reliability.chaos import run_chaos

    return run_chaos(quick=quick, root=root)


def run_soaks(quick: bool, root: Path | None, num: int | None = None) -> dict:
    """The embedded model (the full count), then a tiny random Idefics3 whose images go
    through the preprocessing pool and its /dev/shm blocks (a tenth of the count)."""
    import tempfile

    from benchmarks.reliability.soak import SoakConfig, corpus_bad_images, run_soak
    from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

    bad = corpus_bad_images()
    num = num or (300 if quick else 5000)
    small = {"num_warmup": 50} if quick else {}
    out = {"embedded": run_soak(SoakConfig(num_requests=num, bad_images=bad, **small), root)}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_vlm_checkpoint(Path(tmp) / "idefics3", "idefics3", kv_heads=4))
        cfg = SoakConfig(
            num_requests=num // 10,
            bad_images=bad,
            model_label=(model, "<tiny idefics3>"),
            server_args=("--model", model, "--default-max-tokens", "16"),
            **small,
        )
        out["pool"] = run_soak(cfg, root, title="soak/pool (tiny idefics3)")
    out["passed"] = out["embedded"]["passed"] and out["pool"]["passed"]
    return out


def summary_rows(results: dict) -> list[dict]:
    rows = []

    def add(name: str, r: dict) -> None:
        c, checks = r.get("counts", {}), r.get("checks", r)
        rows.append({
            "section": name, "passed": r["passed"], "requests": c.get("requests"),
            "ok": c.get("ok"), "4xx": c.get("4xx"), "5xx": c.get("5xx"), "lost": c.get("lost"),
            "unexpected": c.get("unexpected"), "leaked_kv": checks.get("leaked_kv_blocks"),
            "integrity": checks.get("check_integrity_ok"),
            "shm_left": checks.get("leftover_shm_blocks"),
        })  # fmt: skip

    for name in SECTIONS:
        r = results.get(name)
        if r is None:
            continue
        if name in ("fuzz", "soak"):
            add(f"{name}/embedded", r["embedded"])
            add(f"{name}/pool", r["pool"])
        elif name == "chaos":
            for sub in ("kill_worker", "encode_raises", "abort_streams", "preemption_storm"):
                add(f"chaos/{sub}", r[sub])
        else:
            add(name, r)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=SECTIONS, action="append", help="repeatable")
    p.add_argument("--quick", action="store_true", help="small sizes")
    p.add_argument("--server-root", type=Path, default=None,
                   help="source tree the servers run (default: this checkout)")  # fmt: skip
    p.add_argument("--soak-requests", type=int, default=None, help="default: 5000 (quick: 300)")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    output = args.output or RESULT_PATH.with_name(
        "reliability_quick.json" if args.quick else RESULT_PATH.name
    )
    sections = args.only or list(SECTIONS)
    print(f"reliability suite: {', '.join(sections)}{' (quick)' if args.quick else ''}; "
          f"{load_average()}")  # fmt: skip
    previous = json.loads(output.read_text()) if args.only and output.is_file() else {}
    results = dict(previous.get("sections", {}))
    seconds = dict(previous.get("seconds", {}))
    for name in sections:
        start = time.perf_counter()
        results[name] = run_section(name, args.quick, args.server_root, args.soak_requests)
        seconds[name] = round(time.perf_counter() - start, 1)
        print(f"[{name}: {'PASS' if results[name]['passed'] else 'FAIL'} in {seconds[name]:.0f} s;"
              f" {load_average()}]")  # fmt: skip
    rows = summary_rows(results)
    print("\n== summary")
    print(table(rows, list(rows[0])))
    print(load_average())
    passed = all(r["passed"] for r in results.values())
    command = "python -m benchmarks.reliability.run " + " ".join(argv or sys.argv[1:])
    write_json(output, {
        "command": command.strip(), "git_rev": git_rev(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_at_end": load_average(), "passed": passed, "summary": rows,
        "seconds": seconds, "sections": results,
    })  # fmt: skip
    print(f"wrote {output}; {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())

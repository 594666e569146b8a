"""Fuzzed images through the HTTP API: the generated corpus (`corpus.generate_corpus`:
hundreds of bad and odd images, each marked ok or bad) sent as `data:` image URLs.

Two servers: the embedded default model (images tiled in the request thread) and a tiny
random Idefics3 checkpoint (images decoded on the preprocessing pool's workers). Pass:
0 server exits, 0 5xx, 0 lost, every bad image a 4xx with a message, every ok image
answered 200; afterwards the KV pool whole, `check_integrity()` clean and no /dev/shm
block outliving the server.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.reliability.common import (
    Outcome,
    chat_body,
    client,
    count,
    data_url,
    gather_limited,
    print_table,
    send,
    user_message,
)
from benchmarks.reliability.server import ServerProcess, shm_blocks


def load_corpus(out_dir: Path, seed: int = 0, num_bad: int = 500) -> list:
    from benchmarks.reliability.corpus import generate_corpus

    return generate_corpus(out_dir, seed=seed, num_bad=num_bad)


async def _send_corpus(url: str, items: list, concurrency: int) -> list[Outcome]:
    async with client(url, timeout=120) as http:
        coros = []
        for i, item in enumerate(items):
            body = chat_body(user_message("describe this", [data_url(item.path.read_bytes())]), 2,
                             stream=i % 4 == 3)  # fmt: skip
            expect = "ok" if item.expect == "ok" else "4xx"
            coros.append(send(http, body, f"expect_{item.expect}", expect))
        outcomes = await gather_limited(coros, concurrency)
    for outcome, item in zip(outcomes, items, strict=True):
        outcome.message = f"{item.path.name}: {outcome.message}"  # names the kind
    return outcomes


def _fuzz_one(name: str, args: tuple[str, ...], items: list, root, concurrency: int) -> dict:
    kw = {"root": root} if root is not None else {}
    with ServerProcess(*args, **kw) as server:
        start = server.settled_vitals()
        outcomes = asyncio.run(_send_corpus(server.url, items, concurrency))
        alive = server.alive
        end = server.settled_vitals() if alive else None
        integrity = server.integrity() if alive else {"ok": False, "error": "server died"}
        pid, command = server.pid, server.command
        exit_code = server.stop()
        log_tail = server.log_tail(2000)
    leftover = shm_blocks(pid)
    c = count(outcomes)
    bad = [o for o in outcomes if o.expect == "4xx"]
    good = [o for o in outcomes if o.expect == "ok"]
    print_table(f"fuzz/{name}: {len(items)} images", outcomes)
    checks = {
        "server_alive": alive,
        "5xx": c["5xx"],
        "lost": c["lost"],
        "bad_refused_4xx_with_message": sum(1 for o in bad if o.verdict == "4xx" and o.message),
        "num_bad": len(bad),
        "good_answered": sum(1 for o in good if o.verdict == "ok"),
        "num_good": len(good),
        "leaked_kv_blocks": None if end is None else int(start.free_blocks - end.free_blocks),
        "check_integrity_ok": bool(integrity.get("ok")),
        "leftover_shm_blocks": len(leftover),
    }
    print("  " + ", ".join(f"{k}={v}" for k, v in checks.items()))
    passed = (alive and c["unexpected"] == 0 and c["lost"] == 0 and c["5xx"] == 0
              and checks["leaked_kv_blocks"] == 0 and checks["check_integrity_ok"]
              and not leftover)  # fmt: skip
    return {
        "passed": bool(passed),
        "server_command": command,
        "counts": c,
        "checks": checks,
        "statuses_of_bad": dict(Counter(str(o.status) for o in bad)),
        "unexpected": [
            f"{o.label} -> {o.verdict} {o.status}: {o.message}"
            for o in outcomes
            if not o.is_expected
        ][:40],  # fmt: skip
        "server_exit_code": exit_code,
        "server_log_tail": None if passed else log_tail,
    }


def run_fuzz(num_bad: int = 500, seed: int = 0, root=None, concurrency: int = 4) -> dict:
    from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        items = load_corpus(Path(tmp) / "corpus", seed, num_bad)
        model = make_vlm_checkpoint(Path(tmp) / "idefics3", "idefics3", kv_heads=4)
        results = {
            "corpus": {
                "num_images": len(items),
                "num_bad": sum(i.expect == "bad" for i in items),
                "num_ok": sum(i.expect == "ok" for i in items),
                "seed": seed,
                "kinds": len({i.kind for i in items}),
            },  # fmt: skip
            "embedded": _fuzz_one(
                "embedded", ("--default-max-tokens", "2"), items, root, concurrency
            ),  # fmt: skip
            "pool": _fuzz_one(
                "pool (tiny idefics3)",
                ("--model", str(model), "--default-max-tokens", "2"),
                items,
                root,
                concurrency,
            ),  # fmt: skip
        }
        results["pool"]["server_command"] = results["pool"]["server_command"].replace(
            str(model), "<tiny idefics3>"
        )
    results["passed"] = results["embedded"]["passed"] and results["pool"]["passed"]
    return results

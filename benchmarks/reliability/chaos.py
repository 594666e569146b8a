"""Chaos: faults injected under load; only the targeted requests may fail.

  * kill_worker: SIGKILL a preprocessing worker while it works on an image (a server on
    a tiny random Idefics3 checkpoint, whose images go through the pool). Every request
    must end 200 (the image retried on a new worker) or 503 with a message (retryable):
    never a 400 blaming the image. The pool comes back to full size, the same images
    are then answered, and no /dev/shm block outlives the server.
  * encode_raises: an in-process server whose engine raises inside the vision encode
    of one marked image. The marked requests fail (any status, with a message); every
    other request in flight beside them is answered.
  * abort_streams: 20% of streams closed mid-way by the client; the rest answered.
  * preemption_storm: a KV pool of a few dozen blocks under many concurrent requests:
    all answered, preemptions counted > 0.
After each: KV free count back to its start and `check_integrity()` clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import tempfile
import time
from pathlib import Path

from benchmarks.reliability.common import (
    Outcome,
    chat_body,
    client,
    count,
    data_url,
    gather_limited,
    png_bytes,
    print_table,
    prompt_text,
    send,
    user_message,
)
from benchmarks.reliability.server import ServerProcess, in_process_server, shm_blocks


def _section(name: str, outcomes: list[Outcome], extra: dict, ok: bool) -> dict:
    counts = count(outcomes)
    passed = ok and counts["unexpected"] == 0 and counts["lost"] == 0
    print_table(f"chaos/{name}", outcomes)
    print("  " + ", ".join(f"{k}={v}" for k, v in extra.items() if not isinstance(v, dict | list)))
    return {"passed": passed, "counts": counts, **extra}


def _settle_checks(server: ServerProcess, start_free: float) -> dict:
    end = server.settled_vitals()
    integrity = server.integrity()
    return {"leaked_kv_blocks": int(start_free - end.free_blocks),
            "check_integrity_ok": bool(integrity.get("ok")), "integrity": integrity}  # fmt: skip


def send_sync(url: str, body: dict) -> Outcome:
    async def one() -> Outcome:
        async with client(url) as http:
            return await send(http, body, "warmup")

    return asyncio.run(one())


def _busy(pid: int) -> bool:
    """A worker on an image is running (R); one waiting for the next is asleep (S)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
    return False


# -- kill a preprocessing worker ------------------------------------------------------------


async def _killer(server: ServerProcess, num_kills: int, stop: asyncio.Event, log: list) -> None:
    """Kill a busy worker `num_kills` times, spaced out; log (pid, busy when killed)."""
    await asyncio.sleep(1.0)
    while len(log) < num_kills and not stop.is_set():
        deadline = time.monotonic() + 2.0
        victim, busy = None, False
        while time.monotonic() < deadline and not stop.is_set():
            pids = server.worker_pids()
            busy_pids = [p for p in pids if _busy(p)]
            if busy_pids:
                victim, busy = busy_pids[0], True
                break
            await asyncio.sleep(0.002)
        if victim is None:
            pids = server.worker_pids()
            victim = pids[0] if pids else None
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
                log.append({"pid": victim, "busy": busy})
        await asyncio.sleep(0.7)


def kill_worker(num_requests: int = 200, num_kills: int = 5, root=None) -> dict:
    from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint

    kw = {"root": root} if root is not None else {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_vlm_checkpoint(Path(tmp) / "idefics3", "idefics3", kv_heads=4)
        with ServerProcess("--model", str(model), "--default-max-tokens", "4", **kw) as server:
            # Big noisy PNGs, a fresh one per request (a repeated image skips the pool: it
            # is cached), keep a worker busy long enough to be caught at it.
            body = lambda i: chat_body(
                user_message(
                    prompt_text(random.Random(i)), [data_url(png_bytes(500 + i, 600, 450))]
                ),
                4,
            )
            bodies = [body(i) for i in range(num_requests)]
            kills: list[dict] = []
            warm = [send_sync(server.url, body(-1 - i)) for i in range(4)]  # pool starts lazily
            assert all(o.verdict == "ok" for o in warm), f"warm-up failed: {warm}"
            start = server.settled_vitals()
            workers_before = server.worker_pids()

            async def load() -> list[Outcome]:
                stop = asyncio.Event()
                async with client(server.url) as http:
                    killer = asyncio.create_task(_killer(server, num_kills, stop, kills))
                    outs = await gather_limited(
                        [send(http, b, "image_during_kills", "retryable") for b in bodies], 6
                    )
                    stop.set()
                    await killer
                    # The images that failed, sent again: answered (they were never bad).
                    again = [b for b, o in zip(bodies, outs, strict=True) if o.verdict != "ok"]
                    outs += await gather_limited(
                        [send(http, b, "failed_image_resent", "ok") for b in again], 4
                    )
                    # An idle worker killed: the next images must not be blamed for it.
                    idle = [p for p in server.worker_pids() if not _busy(p)]
                    if idle:
                        os.kill(idle[0], signal.SIGKILL)
                        kills.append({"pid": idle[0], "busy": False})
                        await asyncio.sleep(0.3)
                    fresh = [body(num_requests + i) for i in range(8)]
                    outs += await gather_limited(
                        [send(http, b, "after_idle_kill", "retryable") for b in fresh], 2
                    )
                return outs

            outcomes = asyncio.run(load())
            time.sleep(0.5)
            workers_after = server.worker_pids()
            alive = server.alive
            checks = _settle_checks(server, start.free_blocks) if alive else {}
            shm_during = server.vitals().shm_blocks if alive else []
            pid = server.pid
            server.stop()
            command = server.command
    leftover = shm_blocks(pid)
    n400 = sum(1 for o in outcomes if o.status == 400)
    n503 = sum(1 for o in outcomes if o.status == 503)
    extra = {
        "server_command": command.replace(str(model), "<tiny idefics3>"),
        "num_kills": len(kills),
        "num_kills_busy": sum(k["busy"] for k in kills),
        "num_400_blaming_image": n400,
        "num_503_retryable": n503,
        "workers_before": len(workers_before),
        "workers_after": len(workers_after),
        "shm_blocks_live": len(shm_during),
        "leftover_shm_blocks": len(leftover),
        "server_alive": alive,
        **checks,
    }
    ok = (alive and len(kills) > 0 and n400 == 0 and n503 <= len(kills)
          and len(workers_after) == len(workers_before) and not leftover
          and checks.get("leaked_kv_blocks") == 0 and checks.get("check_integrity_ok"))  # fmt: skip
    return _section("kill_worker", outcomes, extra, bool(ok))


# -- one request's encode raises ------------------------------------------------------------

MARKER_SEED = 424242  # the image whose encode raises


def _faulty_engine_factory(model_config_kwargs: dict):
    """An Engine whose encoder stage raises on the marker image (matched by the content
    hash of the placeholder the engine was given: no change to the engine's code)."""
    from vlmserve.config import EngineConfig, ModelConfig
    from vlmserve.engine.core import Engine
    from vlmserve.inputs.processing import Request

    marker = png_bytes(MARKER_SEED, 64, 48)

    class FaultyEngine(Engine):
        def __init__(self, config: EngineConfig) -> None:
            super().__init__(config)
            content = [{"type": "image", "image": marker}, {"type": "text", "text": "x"}]
            probe = Request([{"role": "user", "content": content}])
            self.marker_hash = self.prepare(probe).prompt.images[0].content_hash
            # id() -> the marker placeholders' data, held so that no id is reused by a
            # bystander's image after a marked request ends.
            self.marked: dict[int, object] = {}
            self.num_raised = 0
            stage = self.runner.encoder_stage
            original = stage.encode

            def encode(images):
                if any(id(image) in self.marked for image in images):
                    self.num_raised += 1
                    raise RuntimeError("injected fault: encode failed on the marked image")
                return original(images)

            stage.encode = encode

        def add_request(self, request):
            prepared = request if not isinstance(request, Request) else self.prepare(request)
            prompt = prepared.prompt
            for image, work in zip(prompt.images, prompt.works, strict=True):
                if image.content_hash == self.marker_hash:
                    self.marked[id(work)] = work
            return super().add_request(prepared)

    def factory() -> Engine:
        from vlmserve.embedded import DEFAULT_MODEL_DIR

        return FaultyEngine(
            EngineConfig(ModelConfig(str(DEFAULT_MODEL_DIR), **model_config_kwargs))
        )

    return factory, marker


def encode_raises(num_requests: int = 90, num_marked: int = 3) -> dict:
    from vlmserve.server.app import ServerConfig, create_app

    factory, marker = _faulty_engine_factory({})
    app = create_app(factory, ServerConfig(model_name="rel"))
    rng = random.Random(3)
    marked_at = set(rng.sample(range(num_requests // 4, num_requests), num_marked))
    bodies = []
    for i in range(num_requests):
        if i in marked_at:
            # Its own text: no prefix-cache sharing with the others.
            bodies.append(("marked", chat_body(user_message(f"marked {i}", [data_url(marker)]), 8),
                           "any"))  # fmt: skip
        else:
            urls = [data_url(png_bytes(9000 + i, 64, 48))] if i % 2 else []
            bodies.append(("bystander", chat_body(user_message(prompt_text(rng), urls), 8,
                                                  stream=i % 3 == 0), "ok"))  # fmt: skip
    with in_process_server(app) as url:
        engine = app.state.engine_loop.engine
        bm = engine.scheduler.block_manager
        start_free = bm.num_free_blocks

        async def load() -> list[Outcome]:
            async with client(url) as http:
                return await gather_limited([send(http, b, lab, e) for lab, b, e in bodies], 16)

        outcomes = asyncio.run(load())
        deadline = time.monotonic() + 10
        while app.state.engine_loop.num_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        error = None
        try:
            bm.check_integrity()
        except AssertionError as e:
            error = str(e) or "check_integrity failed"
        leaked = start_free - bm.num_free_blocks
        num_raised = engine.num_raised
    marked = [o for o in outcomes if o.label == "marked"]
    extra = {
        "num_marked": len(marked),
        "marked_failed_with_message": sum(1 for o in marked if o.verdict != "ok" and o.message),
        "num_faults_raised": num_raised,
        "bystanders_failed": sum(
            1 for o in outcomes if o.label == "bystander" and o.verdict != "ok"
        ),
        "leaked_kv_blocks": leaked,
        "check_integrity_ok": error is None,
        "integrity_error": error,
    }
    ok = (
        num_raised > 0
        and leaked == 0
        and error is None
        and extra["marked_failed_with_message"] == len(marked)
    )
    return _section("encode_raises", outcomes, extra, ok)


# -- aborted streams and a preemption storm (one tiny-pool server) ----------------------------


def _abort_bodies(num: int, seed: int) -> list[tuple[str, dict, str, int | None]]:
    rng = random.Random(seed)
    out = []
    for i in range(num):
        urls = [data_url(png_bytes(7000 + i, 64, 48))] if i % 2 else []
        body = chat_body(user_message(prompt_text(rng), urls), rng.randint(24, 40), stream=True)
        if rng.random() < 0.2:
            out.append(("stream_aborted", body, "abort", rng.randint(1, 8)))
        else:
            out.append(("stream", body, "ok", None))
    return out


def _storm_bodies(num: int, seed: int) -> list[tuple[str, dict, str, int | None]]:
    """More concurrent requests than a pool of a few dozen blocks holds. Under FCFS
    admission (whole-prompt reservation) their decode growth forces preemptions; the
    default "lumpy" admission reserves min(max_tokens, 256) decode tokens up front and
    may avoid them: then the section fails on num_preemptions == 0 (serve has no
    --admission flag to pick FCFS)."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        urls = [data_url(png_bytes(8000 + i, 96, 64))] if i % 3 == 0 else []
        body = chat_body(user_message(prompt_text(rng), urls), rng.randint(32, 64), i % 2 == 0)
        out.append(("storm", body, "ok", None))
    return out


def aborts_and_preemption(num_streams: int = 200, num_storm: int = 120, num_kv_blocks: int = 40,
                          root=None) -> tuple[dict, dict]:  # fmt: skip
    kw = {"root": root} if root is not None else {}
    # No decode growth reserved at admission: the default (lumpy) policy then admits on the
    # prompt alone, and growth into a 40-block pool preempts (its cheapest-recompute path).
    args = ("--num-kv-blocks", str(num_kv_blocks), "--block-size", "16", "--max-num-seqs", "32",
            "--default-max-tokens", "16", "--decode-reserve-tokens", "0")  # fmt: skip
    with ServerProcess(*args, **kw) as server:
        start = server.settled_vitals()

        async def run(bodies, concurrency):
            async with client(server.url) as http:
                return await gather_limited(
                    [send(http, b, lab, e, abort_after_chunks=k) for lab, b, e, k in bodies],
                    concurrency,
                )

        aborts = asyncio.run(run(_abort_bodies(num_streams, 5), 12))
        abort_checks = _settle_checks(server, start.free_blocks) if server.alive else {}
        before = server.metrics().get("vlmserve_num_preemptions_total", 0.0)
        storm = asyncio.run(run(_storm_bodies(num_storm, 6), 32))
        alive = server.alive
        preemptions = server.metrics().get("vlmserve_num_preemptions_total", 0.0) - before
        storm_checks = _settle_checks(server, start.free_blocks) if alive else {}
        command, pid = server.command, server.pid
        server.stop()
    leftover = len(shm_blocks(pid))
    abort_checks["leftover_shm_blocks"] = storm_checks["leftover_shm_blocks"] = leftover
    abort_extra = {
        "server_command": command,
        "num_aborted": sum(1 for o in aborts if o.verdict == "client_abort"),
        **abort_checks,
    }
    storm_extra = {"server_command": command, "num_preemptions": int(preemptions),
                   "server_alive": alive, **storm_checks}  # fmt: skip
    clean = lambda c: (c.get("leaked_kv_blocks") == 0 and c.get("check_integrity_ok")
                       and c["leftover_shm_blocks"] == 0)  # fmt: skip
    return (
        _section("abort_streams", aborts, abort_extra, bool(clean(abort_checks))),
        _section("preemption_storm", storm, storm_extra,
                 bool(alive and preemptions > 0 and clean(storm_checks))),
    )  # fmt: skip


def run_chaos(quick: bool = False, root=None) -> dict:
    scale = 0.25 if quick else 1.0
    n = lambda x: max(8, int(x * scale))
    results = {"kill_worker": kill_worker(n(200), 2 if quick else 5, root=root)}
    results["encode_raises"] = encode_raises(n(90), 3)
    abort, storm = aborts_and_preemption(n(200), n(120), root=root)
    results["abort_streams"], results["preemption_storm"] = abort, storm
    results["passed"] = all(r["passed"] for r in results.values())
    return results

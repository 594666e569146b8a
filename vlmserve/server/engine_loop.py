"""The engine thread: the one thread that owns the (not thread-safe) Engine.

Callers hand commands in through a thread-safe queue (`submit`, `abort`); the thread
answers each request through its `sink` callback with `Accepted` or `Failed`, then one
`Snapshot` per step that produced tokens, the last with `finished=True`. Snapshots are
immutable copies: the engine mutates its RequestOutput objects in place.

What must stay true: every submitted request gets exactly one terminal item (Failed, or
a finished Snapshot) and then releases its pending slot; an abort is handled before the
next step, so an aborted request's KV blocks are back in the pool within one step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from encoders.errors import RequestError
from vlmserve.engine import Engine, PreparedRequest, RequestOutput
from vlmserve.processing import Request

log = logging.getLogger(__name__)

LoopState = Literal["loading", "ready", "draining", "stopped", "failed"]


class ServerBusyError(RequestError):
    """The bounded admission queue is full: the client should retry later."""

    status = 429


class ServiceUnavailableError(RequestError):
    """The engine is loading, draining or stopped."""

    status = 503


class EngineFailure(RuntimeError):
    """The engine raised inside a step; the requests in that step are failed (500)."""


@dataclass(frozen=True)
class Accepted:
    request_id: str
    process_s: float  # add_request: template, tokenise, image decode and placeholders


@dataclass(frozen=True)
class Failed:
    request_id: str
    error: Exception


@dataclass(frozen=True)
class Snapshot:
    request_id: str
    text: str  # full text so far (cut at a stop string when one matched)
    num_output_tokens: int
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_image_tokens: int
    num_cached_tokens: int


Item = Accepted | Failed | Snapshot
Sink = Callable[[Item], None]


def snapshot(out: RequestOutput) -> Snapshot:
    return Snapshot(
        out.request_id,
        out.text,
        len(out.token_ids),
        out.finished,
        out.finish_reason,
        out.num_prompt_tokens,
        out.num_image_tokens,
        out.num_cached_tokens,
    )


class EngineLoop:
    """Runs `engine_factory()` and then the add/step/abort loop in one daemon thread."""

    def __init__(self, engine_factory: Callable[[], Engine], max_pending: int = 256) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self._factory = engine_factory
        self.max_pending = max_pending
        self.state: LoopState = "loading"
        self.load_error: BaseException | None = None
        self.engine: Engine | None = None
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # loop thread only
        self._lock = threading.Lock()
        self._num_pending = 0  # submitted, no terminal item yet
        self._stats: dict[str, float] = {}
        self._preparers = ThreadPoolExecutor(4, thread_name_prefix="vlmserve-prepare")
        self._early_aborts: set[str] = set()  # loop thread only
        self._thread = threading.Thread(target=self._run, name="vlmserve-engine", daemon=True)

    # -- any thread --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return self._num_pending

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue `request` (its `request_id` must be set). Raises ServerBusyError /
        ServiceUnavailableError instead of queueing without bound."""
        assert request.request_id, "the server names its requests"
        if self.state != "ready":
            raise ServiceUnavailableError(f"the engine is {self.state}")
        with self._lock:
            if self._num_pending >= self.max_pending:
                raise ServerBusyError(
                    f"the server has {self._num_pending} requests in flight, its limit"
                )
            self._num_pending += 1
        # Template, tokenisation and image decode/tiling run on a preparer thread, beside
        # the engine's steps and other requests' preparation; the loop only enqueues.
        self._preparers.submit(self._prepare, request, sink)

    def _prepare(self, request: Request, sink: Sink) -> None:  # a preparer thread
        start = time.perf_counter()
        try:
            prepared = self.engine.prepare(request)
        except Exception as e:  # the request fails, nothing else does
            self._release()
            _emit(sink, Failed(request.request_id, e))
            return
        if self.state == "stopped":  # the loop is gone: nobody will read the inbox
            self._release()
            _emit(sink, Failed(request.request_id, ServiceUnavailableError("shut down")))
            return
        self._inbox.put(("add", prepared, sink, time.perf_counter() - start))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def begin_drain(self) -> None:
        """Refuse new requests (503) and let the running ones finish."""
        if self.state in ("loading", "ready"):
            self.state = "draining"

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is still in flight (503) and end the thread."""
        self.begin_drain()
        self._preparers.shutdown(wait=False)
        self._inbox.put(("stop",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> dict[str, float]:
        """Engine-side gauges as of the last step (a dict swapped in whole)."""
        return {**self._stats, "pending": float(self._num_pending)}

    # -- the loop thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # reported by /health, never raised
            log.exception("engine failed to load")
            self.load_error, self.state = e, "failed"
            self._fail_inbox(ServiceUnavailableError(f"the engine failed to load: {e}"))
            return
        if self.state == "loading":
            self.state = "ready"
        self._publish()
        engine = self.engine
        while True:
            if not self._handle_commands(block=not engine.has_unfinished()):
                break
            if engine.has_unfinished():
                self._step()
            self._publish()
        for request_id in list(self._sinks):
            engine.abort(request_id)
            self._terminal(request_id, Failed(request_id, ServiceUnavailableError("shut down")))
        self.state = "stopped"
        self._fail_inbox(ServiceUnavailableError("the server is shutting down"))
        self._publish()

    def _handle_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one when idle). False on stop."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            if command[0] == "add":
                self._add(command[1], command[2], command[3])
            else:
                self._abort(command[1])
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: PreparedRequest, sink: Sink, process_s: float) -> None:
        request_id = request.request_id
        if request_id in self._early_aborts:  # its client left while it was being prepared
            self._early_aborts.discard(request_id)
            self._release()
            _emit(sink, Failed(request_id, EngineFailure("aborted before it started")))
            return
        try:
            self.engine.add_request(request)
        except Exception as e:  # the request fails, the loop goes on
            self._release()
            _emit(sink, Failed(request_id, e))
            return
        self._sinks[request_id] = sink
        _emit(sink, Accepted(request_id, process_s))

    def _abort(self, request_id: str) -> None:
        if request_id not in self._sinks:
            # Finished already, or still being prepared: then it is dropped on arrival.
            if self._num_pending > len(self._sinks):
                self._early_aborts.add(request_id)
            return
        out = self.engine.abort(request_id)
        if out is None:
            self._terminal(request_id, Failed(request_id, EngineFailure("request vanished")))
        else:
            self._terminal(request_id, snapshot(out))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # fail what was in flight, keep serving
            log.exception("engine step failed; failing its requests")
            for request_id in list(self._sinks):
                try:
                    self.engine.abort(request_id)
                except Exception:
                    log.exception("abort after a failed step")
                self._terminal(request_id, Failed(request_id, EngineFailure(str(e))))
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                self._terminal(out.request_id, snapshot(out))
            else:
                _emit(sink, snapshot(out))

    def _terminal(self, request_id: str, item: Item) -> None:
        sink = self._sinks.pop(request_id)
        self._release()
        _emit(sink, item)

    def _release(self) -> None:
        with self._lock:
            self._num_pending -= 1
            assert self._num_pending >= 0, "more terminal items than submitted requests"

    def _fail_inbox(self, error: Exception) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._release()
                _emit(command[2], Failed(command[1].request_id, error))

    def _publish(self) -> None:
        self._stats = self.engine.stats()


def _emit(sink: Sink, item: Item) -> None:
    try:
        sink(item)
    except Exception:  # a dead consumer must not stop the loop
        log.exception("request sink failed")

"""The engine thread: the one thread that owns the (not thread-safe) Engine.

Callers hand commands in through a thread-safe queue (`submit`, `abort`); the thread
answers each request through its `sink` callback with `Accepted` or `Failed`, then one
`Snapshot` per step that produced tokens (each carries the new text only), the last with
`finished=True`. Snapshots are immutable copies: the engine mutates its RequestOutput
objects in place.

What must stay true:
- every submitted request gets exactly one terminal item (Failed, or a finished
  Snapshot) and then releases its pending slot — also when the loop stops or dies while
  the request is still being prepared (it is answered then, not when preparation ends);
- an abort is handled before the next step, so an aborted request's KV blocks are back
  in the pool within one step; an abort of a request still being prepared drops it when
  preparation ends, and an abort of a finished one leaves nothing behind;
- the loop is supervised: an exception escaping it (a bug in the engine's bookkeeping —
  request failures are handled inside `Engine.step`) marks the loop `failed` at once,
  fails every request in flight with 500, refuses new ones with 503 and calls `on_death`
  (the server then exits non-zero: a live port never fronts a dead engine).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from encoders.errors import RequestError
from vlmserve.engine.core import Engine, PreparedRequest, RequestOutput
from vlmserve.engine.request_options import child_request
from vlmserve.inputs.processing import Request
from vlmserve.inputs.shared_tokenizer import NUM_PREPARE_THREADS
from vlmserve.sample.logprobs import TokenLogprob
from vlmserve.sample.params import SamplingParams

log = logging.getLogger(__name__)

LoopState = Literal["loading", "ready", "draining", "stopped", "failed"]


class ServerBusyError(RequestError):
    """The bounded admission queue is full: the client should retry later."""

    status = 429


class ServiceUnavailableError(RequestError):
    """The engine is loading, draining or stopped."""

    status = 503


class EngineFailure(RuntimeError):
    """The engine failed on a request (not on its input), or the engine died: 500."""

    status = 500


class RequestAborted(RuntimeError):
    """Aborted (its client left) before it reached the engine."""

    status = 499


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
    delta: str  # text since the previous snapshot (cut at a stop string when one matched)
    num_output_tokens: int
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_image_tokens: int
    num_cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # of the new tokens, when the request asked
    # Prompt logprobs (None at position 0), on the first snapshot with tokens and the last.
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    first_prompt_token_id: int | None = None


Item = Accepted | Failed | Snapshot
Sink = Callable[[Item], None]


def snapshot(out: RequestOutput) -> Snapshot:
    prompt: tuple[TokenLogprob | None, ...] = ()
    first = len(out.token_ids) == len(out.new_token_ids)
    if out.prompt_logprobs is not None and (first or out.finished):
        prompt = tuple(out.prompt_logprobs)
    return Snapshot(
        out.request_id,
        out.text_delta,
        len(out.token_ids),
        out.finished,
        out.finish_reason,
        out.num_prompt_tokens,
        out.num_image_tokens,
        out.num_cached_tokens,
        tuple(out.new_logprobs),
        prompt,
        out.prompt_token_ids[0] if out.prompt_token_ids else None,
    )


def failure_of(out: RequestOutput) -> Exception:
    """The error a request that finished with `finish_reason="error"` is answered with."""
    status = out.error_status or 500
    if status == 500:
        return EngineFailure(out.error or "the engine failed on this request")
    error = RequestError(out.error or "the request failed")  # 4xx, or a retryable 503
    error.status = status
    return error


@dataclass
class _Preparing:
    sink: Sink
    aborted: bool = False


class EngineLoop:
    """Runs `engine_factory()` and then the add/step/abort loop in one daemon thread."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        max_pending: int = 256,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self._factory = engine_factory
        self.max_pending = max_pending
        self.on_death = on_death
        self.state: LoopState = "loading"
        self.load_error: BaseException | None = None  # why the engine failed or died
        self.engine: Engine | None = None
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # loop thread only
        # Guards _num_pending, _preparing and _closed: a preparer's check-and-enqueue and
        # the loop's close are atomic with respect to each other.
        self._lock = threading.Lock()
        self._num_pending = 0  # submitted, no terminal item yet
        self._preparing: dict[str, _Preparing] = {}  # submitted, not yet in the inbox
        self._closed: Exception | None = None  # set once: what late requests get
        self._stats: dict[str, float] = {}
        # As many as the prompt processor has tokenizer copies ready (`NUM_PREPARE_THREADS`).
        self._preparers = ThreadPoolExecutor(
            NUM_PREPARE_THREADS, thread_name_prefix="vlmserve-prepare"
        )
        self._thread = threading.Thread(target=self._run, name="vlmserve-engine", daemon=True)

    # -- any thread --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return self._num_pending

    def submit(self, request: Request, sink: Sink, children: Sequence[Request] = ()) -> None:
        """Queue `request` (its `request_id` must be set) and the `children` made from its
        one preparation (n > 1: each with its own id and sampling parameters, sharing its
        prompt). Raises ServerBusyError / ServiceUnavailableError instead of queueing
        without bound."""
        request_ids = [request.request_id, *(child.request_id for child in children)]
        assert all(request_ids), "the server names its requests"
        with self._lock:
            if self.state != "ready" or self._closed is not None:
                raise ServiceUnavailableError(f"the engine is {self.state}")
            if self._num_pending + len(request_ids) > self.max_pending:
                raise ServerBusyError(
                    f"the server has {self._num_pending} requests in flight, its limit"
                )
            self._num_pending += len(request_ids)
            for request_id in request_ids:
                self._preparing[request_id] = _Preparing(sink)
        # Template, tokenisation and image decode/tiling run on a preparer thread, beside
        # the engine's steps and other requests' preparation; the loop only enqueues.
        try:
            self._preparers.submit(self._prepare, request, tuple(children))
        except RuntimeError:  # the executor is shut down: stopping
            with self._lock:
                for request_id in request_ids:
                    if self._preparing.pop(request_id, None) is not None:
                        self._num_pending -= 1
            raise ServiceUnavailableError("the server is shutting down") from None

    def _prepare(self, request: Request, children: tuple[Request, ...]) -> None:  # a preparer
        start = time.perf_counter()
        try:
            prepared, error = self.engine.prepare(request), None
        except Exception as e:  # the request fails, nothing else does
            prepared, error = None, e
        made: list[tuple[str, PreparedRequest | None]] = [(request.request_id, prepared)]
        for child in children:  # the parent's preparation, the child's own id and params
            if prepared is not None:
                params = child.sampling or SamplingParams()
                one = child_request(prepared, child.request_id, params, child.share_prompt_with)
            made.append((child.request_id, one if prepared is not None else None))
        failed = []
        with self._lock:
            for request_id, one in made:
                entry = self._preparing.pop(request_id, None)
                if entry is None:
                    continue  # answered already: the loop stopped or died meanwhile
                if error is None and not entry.aborted:
                    self._inbox.put(("add", one, entry.sink, time.perf_counter() - start))
                    continue
                self._num_pending -= 1
                failed.append((request_id, entry.sink))
        for request_id, sink in failed:
            _emit(sink, Failed(request_id, error or RequestAborted("aborted by the client")))

    def abort(self, request_id: str) -> None:
        with self._lock:
            entry = self._preparing.get(request_id)
            if entry is not None:
                entry.aborted = True  # dropped when its preparation ends
                return
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
            self._die(e, ServiceUnavailableError("the engine failed to load"))
            return
        with self._lock:
            if self.state == "loading":
                self.state = "ready"
        try:
            self._publish()
            self._serve()
        except BaseException as e:  # supervision: never a live port on a dead engine
            log.exception("the engine loop died")
            self._die(e, EngineFailure("the engine died; the server is shutting down"))
            return
        self._close(ServiceUnavailableError("the server is shutting down"))
        self.state = "stopped"
        self._publish()

    def _serve(self) -> None:
        engine = self.engine
        while self._handle_commands(block=not engine.has_unfinished()):
            if engine.has_unfinished():
                self._step()
            self._publish()

    def _die(self, cause: BaseException, error: Exception) -> None:
        self.load_error, self.state = cause, "failed"
        self._close(error)
        if self.on_death is not None:
            try:
                self.on_death(cause)
            except Exception:
                log.exception("on_death callback failed")

    def _close(self, error: Exception) -> None:
        """Answer everything in flight with `error`; later requests get it too."""
        with self._lock:
            self._closed = error
            preparing, self._preparing = self._preparing, {}
            self._num_pending -= len(preparing)
        for request_id, entry in preparing.items():
            _emit(entry.sink, Failed(request_id, error))
        for request_id in list(self._sinks):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine may be what broke
                log.exception("abort while closing")
            self._terminal(request_id, Failed(request_id, error))
        while True:  # adds enqueued before _closed was set
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._release()
                _emit(command[2], Failed(command[1].request_id, error))

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
            return  # finished already (its abort arrived after the terminal item)
        out = self.engine.abort(request_id)
        if out is None:
            self._terminal(request_id, Failed(request_id, EngineFailure("request vanished")))
        else:
            self._terminal(request_id, snapshot(out))

    def _step(self) -> None:
        for out in self.engine.step():  # failures inside are per request (see Engine.step)
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finish_reason == "error":
                self._terminal(out.request_id, Failed(out.request_id, failure_of(out)))
            elif out.finished:
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

    def _publish(self) -> None:
        self._stats = self.engine.stats()


def _emit(sink: Sink, item: Item) -> None:
    try:
        sink(item)
    except Exception:  # a dead consumer must not stop the loop
        log.exception("request sink failed")

"""One API request's choices: n (or best_of) engine requests, one per choice and prompt,
answered through one sink and told apart by request id.

Choice i of a prompt is the engine request `<id>-<i>` with seed + i (when seeded) and
waits for choice 0's prefill to share its prompt's KV (`engine.request_options`). A
choice that fails before the answer starts fails the whole request (the others are
aborted); the answer is complete when every choice has its terminal item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from vlmserve.engine.request_options import child_params, num_children
from vlmserve.inputs.processing import Request
from vlmserve.sample.logprobs import TokenLogprob
from vlmserve.sample.params import SamplingParams
from vlmserve.server.engine_loop import Accepted, EngineLoop, Failed, Item, Snapshot

_DISCONNECT_POLL_S = 0.25


class AsyncSink:
    """The engine thread's callback into this request's asyncio queue."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Item] = asyncio.Queue()

    def __call__(self, item: Item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_index: int = 0
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: Snapshot | None = None  # the newest snapshot; terminal once `finished`
    prompt_logprobs: tuple = ()  # when asked (choice 0 of its prompt computes them)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def done(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def cumulative_logprob(self) -> float:
        return sum(r.logprob for r in self.logprobs)


def fan_out(base: Request, params: SamplingParams, request_id: str, first_index: int = 0):
    """The engine requests of one prompt's choices (`<request_id>-<i>`), choice i >= 1
    sharing choice 0's prompt KV. Returns [(choice index, Request)]."""
    if num_children(params) == 1 and first_index == 0:
        return [(0, dataclasses.replace(base, sampling=params, request_id=request_id))]
    ids = [f"{request_id}-{first_index + i}" for i in range(num_children(params))]
    return [
        (first_index + i, dataclasses.replace(
            base, sampling=child_params(params, i), request_id=rid,
            share_prompt_with=ids[0] if i else None,
        ))
        for i, rid in enumerate(ids)
    ]  # fmt: skip


class Choices:
    """The engine requests behind one API request and what each has produced."""

    def __init__(self, loop: EngineLoop, on_snapshot: Callable[[Snapshot], None]) -> None:
        self.loop, self.on_snapshot = loop, on_snapshot
        self.sink = AsyncSink()
        self.choices: dict[str, Choice] = {}
        self.process_s = 0.0
        self._submitted: set[str] = set()
        self._early: list[Item] = []  # items that came before every choice was admitted

    def submit(self, requests: list[tuple[int, Request]], prompt_index: int = 0) -> None:
        """Queue the requests, each that shares a sibling's prompt with that sibling, so
        the prompt is prepared once (template, tokens, images) and the engine holds the
        choice for the sibling's prefill. A refusal (429 / 503) aborts those queued."""
        children: dict[str, list[Request]] = {}
        for index, request in requests:
            self.choices[request.request_id] = Choice(index, request.request_id, prompt_index)
            if request.share_prompt_with is not None:
                children.setdefault(request.share_prompt_with, []).append(request)
        for _, request in requests:
            if request.share_prompt_with is None:
                self._submit(request, children.get(request.request_id, []))

    def _submit(self, request: Request, children: list[Request]) -> None:
        try:
            self.loop.submit(request, self.sink, children)
        except Exception:
            self.abort()
            raise
        self._submitted.update([request.request_id, *(c.request_id for c in children)])

    def abort(self) -> None:
        for choice in self.choices.values():
            if not choice.done and choice.request_id in self._submitted:
                self.loop.abort(choice.request_id)

    async def accepted(self) -> Failed | None:
        """Wait until every request is admitted; the first failure aborts the others. A
        choice admitted early may send snapshots meanwhile: they are kept, in order."""
        waiting = len(self.choices)
        while waiting:
            item = await self.sink.queue.get()
            if isinstance(item, Failed):
                self.abort()
                return item
            if isinstance(item, Accepted):
                waiting -= 1
                self.process_s = max(self.process_s, item.process_s)
            else:
                self._early.append(item)
        return None

    def take(self, item: Snapshot) -> Choice:
        choice = self.choices[item.request_id]
        choice.last = item
        choice.pieces.append(item.delta)
        choice.logprobs.extend(item.logprobs)
        if item.prompt_logprobs:
            choice.prompt_logprobs = item.prompt_logprobs
        self.on_snapshot(item)
        return choice

    @property
    def done(self) -> bool:
        return all(choice.done for choice in self.choices.values())

    async def next_item(self) -> Item:
        if self._early:
            return self._early.pop(0)
        return await self.sink.queue.get()

    async def complete(self, is_disconnected: Callable) -> Failed | None:
        """Take items until every choice is done (a failure aborts the rest). Polls for a
        client that left, since nothing is sent before the end."""
        next_check = time.monotonic() + _DISCONNECT_POLL_S
        finished = False
        try:
            while not self.done:
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + _DISCONNECT_POLL_S
                    if await is_disconnected():
                        self.abort()
                try:
                    item = await asyncio.wait_for(self.next_item(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                if isinstance(item, Failed):
                    self.abort()
                    finished = True
                    return item
                if isinstance(item, Snapshot) and item.request_id in self.choices:
                    self.take(item)
            finished = True
            return None
        finally:
            if not finished:
                self.abort()  # cancelled (server shutting down)

    def prompt_logprobs(self, prompt_index: int) -> list[TokenLogprob]:
        """The prompt's logprobs after its first token, from whichever choice has them."""
        for choice in self.choices.values():
            if choice.prompt_index == prompt_index and choice.prompt_logprobs:
                return [r for r in choice.prompt_logprobs[1:] if r is not None]
        return []

    def ordered(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)


async def stream_items(choices: Choices, first: Item) -> AsyncIterator[Item]:
    """Every item until each choice is done or one fails (the failure is yielded)."""
    item: Item | None = first
    while not choices.done:
        if item is None:
            item = await choices.next_item()
        if isinstance(item, Failed):
            choices.abort()
            yield item
            return
        if isinstance(item, Snapshot) and item.request_id in choices.choices:
            yield item
        item = None

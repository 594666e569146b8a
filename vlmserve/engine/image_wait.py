"""Waiting sequences whose images are still being decoded and tiled in the pool, or whose
structured-output grammar is still compiling: which are ready, which failed, and a short
wait when the engine has nothing else to do."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent import futures

from encoders.stage import ImageWork
from scheduler.sequence import Sequence

# Longest an idle step waits for an image decode (the engine thread has nothing else).
IMAGE_POLL_S = 0.005


def poll_images(
    waiting: Iterable[Sequence], holding: Callable[[Sequence], bool] | None = None
) -> list[tuple[Sequence, Exception]]:
    """Mark sequences whose images are all decoded ready (unless `holding` them for
    something else); return those whose decode failed, with the error (the engine fails
    them alone). Never blocks."""
    failed = []
    for seq in [s for s in waiting if not s.ready]:
        if pending_images(seq) or (holding is not None and holding(seq)):
            continue
        try:
            for image in seq.images:
                if isinstance(image.data, ImageWork):
                    image.data.wait()  # done: records timings, raises a decode error
        except Exception as e:  # noqa: BLE001 - this request's image alone
            failed.append((seq, e))
            continue
        seq.ready = True
    return failed


def wait_for_images(waiting: Iterable[Sequence], others: Iterable[futures.Future] = ()) -> None:
    """Nothing to run but images still decoding (or `others`, e.g. grammars compiling):
    wait briefly for one of them rather than spin (short, so new requests and aborts are
    still taken promptly)."""
    pending = [f for s in waiting for f in pending_images(s)] + [f for f in others if not f.done()]
    if pending:
        futures.wait(pending, timeout=IMAGE_POLL_S, return_when=futures.FIRST_COMPLETED)


def pending_images(seq: Sequence) -> list[futures.Future]:
    """Futures of `seq`'s images still being decoded and tiled in the pool."""
    return [
        image.data.future
        for image in seq.images
        if isinstance(image.data, ImageWork)
        and image.data.future is not None
        and not image.data.future.done()
    ]


def poll_grammars(
    waiting: Iterable[Sequence], grammar_of: Callable[[str], object]
) -> tuple[set[str], list[tuple[Sequence, Exception]]]:
    """The waiting sequences whose grammar (`grammar_of(request_id)`: a RequestGrammar or
    None) is still compiling, and those whose compile failed or ran out of time. Never
    blocks: a compile is polled like an image decode."""
    compiling, failed = set(), []
    for seq in [s for s in waiting if not s.ready]:
        grammar = grammar_of(seq.request_id)
        if grammar is None:
            continue
        try:
            if not grammar.ready():
                compiling.add(seq.request_id)
        except Exception as e:  # noqa: BLE001 - this request's constraint alone
            failed.append((seq, e))
    return compiling, failed

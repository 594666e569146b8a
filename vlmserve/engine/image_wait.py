"""Requests whose images are still being decoded and tiled in the pool (or whose
structured-output grammar is still compiling): which are ready, which failed, and a short
wait when the engine has nothing else to do. A request's images
are its encoder records (`ProcessedPrompt.works`: ImageWork, or a VisionInput that needs
no wait)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent import futures

from encoders.stage import ImageWork

# Longest an idle step waits for an image decode (the engine thread has nothing else).
IMAGE_POLL_S = 0.005


def poll_images(
    unready: Mapping[str, list[object]],
) -> tuple[list[str], list[tuple[str, Exception]]]:
    """Of the requests (id -> image records) not ready yet: those whose images are all
    decoded, and those whose decode failed, with the error (the engine fails them alone).
    Never blocks."""
    ready, failed = [], []
    for request_id, works in unready.items():
        if pending_images(works):
            continue
        try:
            for work in works:
                if isinstance(work, ImageWork):
                    work.wait()  # done: records timings, raises a decode error
        except Exception as e:  # noqa: BLE001 - this request's image alone
            failed.append((request_id, e))
            continue
        ready.append(request_id)
    return ready, failed


def wait_for_images(unready: Iterable[list[object]], others: Iterable[futures.Future] = ()) -> None:
    """Nothing to run but images still decoding (or `others`, e.g. grammars compiling):
    wait briefly for one of them rather than spin (short, so new requests and aborts are
    still taken promptly)."""
    pending = [f for works in unready for f in pending_images(works)]
    pending += [f for f in others if not f.done()]
    if pending:
        futures.wait(pending, timeout=IMAGE_POLL_S, return_when=futures.FIRST_COMPLETED)


def pending_images(works: Iterable[object]) -> list[futures.Future]:
    """Futures of images still being decoded and tiled in the pool."""
    return [
        work.future
        for work in works
        if isinstance(work, ImageWork) and work.future is not None and not work.future.done()
    ]


def poll_grammars(
    grammars: Mapping[str, object],
) -> tuple[set[str], list[tuple[str, Exception]]]:
    """Of the requests (id -> RequestGrammar or None) not ready yet: those whose grammar is
    still compiling, and those whose compile failed or ran out of time. Never blocks: a
    compile is polled like an image decode."""
    compiling, failed = set(), []
    for request_id, grammar in grammars.items():
        if grammar is None:
            continue
        try:
            if not grammar.ready():
                compiling.add(request_id)
        except Exception as e:  # noqa: BLE001 - this request's constraint alone
            failed.append((request_id, e))
    return compiling, failed

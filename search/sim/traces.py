"""Request traces for the simulator: arrivals (Poisson, bursts), named mixes, JSONL files.

A trace is a list of `TraceRequest`s sorted by arrival. Images are described by what
admission can know before a pixel is decoded: a content hash (repeats of one image share
it) and a tile count (§17: 1–13 tiles). Seeded: the same arguments give the same trace.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

MIXES = ("chat", "vlm", "lumpy")


@dataclass(frozen=True)
class TraceImage:
    content_hash: str
    num_tiles: int

    def __post_init__(self) -> None:
        if self.num_tiles < 1:
            raise ValueError(
                f"image {self.content_hash!r}: num_tiles={self.num_tiles} must be >= 1"
            )


@dataclass(frozen=True)
class TraceRequest:
    """One request: when it arrives, its class (what percentiles are grouped by), its
    prompt (a shared system prompt, images, then the user's text) and its output cap."""

    request_id: str
    arrival_s: float
    request_class: str
    num_text_tokens: int
    max_tokens: int
    images: tuple[TraceImage, ...] = field(default_factory=tuple)
    num_system_tokens: int = 0  # the same for every request: a shared, cacheable prefix
    system_prompt_id: int = 0  # which system prompt (0: the one every mix shares)
    # A conversation: its turns' text is one growing token stream, so a later turn's
    # prompt starts with an earlier one's (prefix-cache hits). None: text unique to it.
    session_id: str | None = None

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"{self.request_id}: arrival_s={self.arrival_s} must be >= 0")
        if self.num_text_tokens < 1 or self.max_tokens < 1 or self.num_system_tokens < 0:
            raise ValueError(
                f"{self.request_id}: need text tokens >= 1, max_tokens >= 1, system tokens >= 0"
            )


# --- arrivals -------------------------------------------------------------------------


def poisson_arrivals(
    rate: float, num: int, rng: random.Random, start_s: float = 0.0
) -> list[float]:
    """`num` arrival times of a Poisson process of `rate` requests/s from `start_s`."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be > 0")
    times, t = [], start_s
    for _ in range(num):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def burst_arrivals(start_s: float, num: int, window_s: float, rng: random.Random) -> list[float]:
    """`num` arrivals spread uniformly over [start_s, start_s + window_s], sorted."""
    return sorted(start_s + rng.random() * window_s for _ in range(num))


# --- mixes ----------------------------------------------------------------------------

SYSTEM_TOKENS = 32


def _text(rid: str, t: float, rng: random.Random) -> TraceRequest:
    return TraceRequest(
        rid, t, "text", rng.randint(20, 400), rng.randint(32, 256), (), SYSTEM_TOKENS
    )


def _image_request(
    rid: str, t: float, rng: random.Random, images: tuple[TraceImage, ...], cls: str
) -> TraceRequest:
    return TraceRequest(
        rid, t, cls, rng.randint(10, 60), rng.randint(32, 256), images, SYSTEM_TOKENS
    )


def vlm_request(rid: str, t: float, rng: random.Random, seen: list[TraceImage]) -> TraceRequest:
    """The `vlm` mix: 40% text chat, 30% one image, 15% 2–4 images, 15% a follow-up
    question about an image seen before (same hash: encoder- and prefix-cache hits)."""
    u = rng.random()
    if u < 0.40:
        return _text(rid, t, rng)
    if u < 0.85 or not seen:
        count = 1 if u < 0.70 else rng.randint(2, 4)
        images = tuple(TraceImage(f"{rid}-{i}", rng.randint(1, 13)) for i in range(count))
        seen.extend(images)
        return _image_request(rid, t, rng, images, "image" if count == 1 else "multi-image")
    return _image_request(rid, t, rng, (rng.choice(seen[-50:]),), "repeat-image")


def make_mix(name: str, num_requests: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """A named mix: ``chat`` (text only), ``vlm`` (the image mix above) or ``lumpy``
    (text chat with a burst of 4-image 13-tile requests a third of the way in)."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    rng = random.Random(seed)
    if name == "lumpy":
        num_burst = max(1, num_requests // 40)
        duration = (num_requests - num_burst) / rate
        return lumpy_trace(rate, duration, duration / 3, num_burst, 2.0, seed)
    if name not in MIXES:
        raise ValueError(f"unknown mix {name!r}; choose one of {', '.join(MIXES)}")
    times = poisson_arrivals(rate, num_requests, rng)
    seen: list[TraceImage] = []
    out = []
    for i, t in enumerate(times):
        rid = f"r{i}"
        out.append(_text(rid, t, rng) if name == "chat" else vlm_request(rid, t, rng, seen))
    return out


def lumpy_trace(
    text_rate: float,
    duration_s: float,
    burst_at_s: float,
    num_burst: int,
    burst_window_s: float,
    seed: int = 0,
    num_never_fits: int = 0,
    never_fits_max_tokens: int = 1 << 20,
    num_bursts: int = 1,
    burst_period_s: float = 60.0,
) -> list[TraceRequest]:
    """Steady Poisson text chat for `duration_s`, plus `num_burst` requests of four
    13-tile images arriving within `burst_window_s` of `burst_at_s` (and again every
    `burst_period_s`, `num_bursts` times in all, with new images each time), plus
    `num_never_fits` first-burst requests whose output cap no KV pool can hold. With one
    burst the trace is the same as before bursts could recur."""
    if num_bursts < 1 or burst_period_s <= 0:
        raise ValueError(f"need num_bursts >= 1 and burst_period_s > 0, got {num_bursts}, "
                         f"{burst_period_s}")  # fmt: skip
    rng = random.Random(seed)
    text_times = poisson_arrivals(text_rate, max(1, int(text_rate * duration_s * 2)), rng)
    out = [_text(f"t{i}", t, rng) for i, t in enumerate(x for x in text_times if x < duration_s)]
    for burst in range(num_bursts):
        start = burst_at_s + burst * burst_period_s
        prefix = "b" if burst == 0 else f"b{burst}."  # b3, then b1.3, b2.3, ...
        for i, t in enumerate(burst_arrivals(start, num_burst, burst_window_s, rng)):
            images = tuple(TraceImage(f"{prefix}{i}-{k}", 13) for k in range(4))
            out.append(_image_request(f"{prefix}{i}", t, rng, images, "4x13-tile"))
    for i, t in enumerate(burst_arrivals(burst_at_s, num_never_fits, burst_window_s, rng)):
        images = (TraceImage(f"n{i}", 13),)
        out.append(
            TraceRequest(f"n{i}", t, "never-fits", 30, never_fits_max_tokens, images, SYSTEM_TOKENS)
        )
    return sorted(out, key=lambda r: r.arrival_s)


# --- files ----------------------------------------------------------------------------


def to_jsonl(trace: list[TraceRequest]) -> str:
    lines = []
    for r in trace:
        doc = {
            "request_id": r.request_id,
            "arrival_s": r.arrival_s,
            "class": r.request_class,
            "text_tokens": r.num_text_tokens,
            "max_tokens": r.max_tokens,
            "system_tokens": r.num_system_tokens,
            "images": [{"hash": im.content_hash, "tiles": im.num_tiles} for im in r.images],
        }
        if r.system_prompt_id or r.session_id is not None:
            doc.update(system_prompt_id=r.system_prompt_id, session_id=r.session_id)
        lines.append(json.dumps(doc))
    return "\n".join(lines) + "\n"


def read_jsonl(path: str | Path) -> list[TraceRequest]:
    """A trace file: one JSON object a line, fields as `to_jsonl` writes them (only
    ``arrival_s``, ``text_tokens`` and ``max_tokens`` are required)."""
    out = []
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc}") from exc
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            images = tuple(
                TraceImage(str(im["hash"]), int(im["tiles"])) for im in doc.get("images", [])
            )
            out.append(
                TraceRequest(
                    request_id=str(doc.get("request_id", f"line{n}")),
                    arrival_s=float(doc["arrival_s"]),
                    request_class=str(doc.get("class", "image" if images else "text")),
                    num_text_tokens=int(doc["text_tokens"]),
                    max_tokens=int(doc["max_tokens"]),
                    images=images,
                    num_system_tokens=int(doc.get("system_tokens", 0)),
                    system_prompt_id=int(doc.get("system_prompt_id", 0)),
                    session_id=doc.get("session_id"),
                )
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace {path} line {n}: {exc}") from exc
    if not out:
        raise ValueError(f"trace {path} holds no requests")
    return sorted(out, key=lambda r: r.arrival_s)
